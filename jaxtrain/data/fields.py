"""The data pipeline's fields of TrainingArguments: their checks (run from TrainingArguments'
validation, argument_checks.SUBSYSTEM_CHECKS) and `DataSettings`, the typed view of them the
pipeline reads (built from the arguments here, in one place)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.argument_checks import check_choice, check_positive
from jaxtrain.data.collate import TRUNCATION_MODES
from jaxtrain.errors import ArgumentError

BOOLEAN_FIELDS = (
    "packing",
    "split_long_documents",
    "drop_last",
    "completion_only_loss",
    "streaming",
)


def check_arguments(args: Any) -> None:
    """ArgumentError naming the first data field that is wrong; normalises CLI lists."""
    check_choice(args, "truncation_mode", TRUNCATION_MODES)
    for name in BOOLEAN_FIELDS:
        if not isinstance(getattr(args, name), bool):
            raise ArgumentError(f"TrainingArguments.{name} must be true or false.")
    if isinstance(args.ids_to_pop_from_dataset, str):  # CLI: --ids_to_pop_from_dataset a,b
        args.ids_to_pop_from_dataset = [
            c.strip() for c in args.ids_to_pop_from_dataset.split(",") if c.strip()
        ]
    pop = args.ids_to_pop_from_dataset
    if pop is not None and not all(isinstance(c, str) and c for c in pop):
        raise ArgumentError(
            f"TrainingArguments.ids_to_pop_from_dataset must be a list of column names, got {pop!r}."
        )
    if pop and "input_ids" in pop:
        raise ArgumentError("TrainingArguments.ids_to_pop_from_dataset must not drop 'input_ids'.")
    if not isinstance(args.messages_column, str) or not args.messages_column:
        raise ArgumentError("TrainingArguments.messages_column must be a non-empty column name.")
    if args.chat_template is not None and not str(args.chat_template).strip():
        raise ArgumentError("TrainingArguments.chat_template must be a Jinja template or None.")
    for name in ("stream_window", "packing_window"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentError(f"TrainingArguments.{name} must be an int, got {value!r}.")
        check_positive(args, name)
    if (args.packing or args.streaming) and args.max_steps <= 0:
        which = "packing" if args.packing else "streaming"
        raise ArgumentError(
            f"TrainingArguments.{which}=True has no fixed epoch length; set max_steps "
            "(e.g. --max_steps 1000)."
        )


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """What the data pipeline reads of a run's arguments, and nothing else."""

    seq_len: int  # max_sequence_length
    global_batch_size: int  # total_batch_size: rows of one update, over every host
    accumulation_steps: int  # gradient_accumulation_steps
    eval_batch_size: int  # eval_batch_size, default the micro-batch size
    seed: int = 0
    shuffle: bool = True  # shuffle_train
    drop_last: bool = False
    truncation_mode: str = "keep_start"
    packing: bool = False
    packing_window: int = 64
    split_long_documents: bool = True
    streaming: bool = False
    stream_window: int = 1024
    # The run's length is fixed by max_steps (else by epochs of the data).
    fixed_length: bool = False
    epoch_evaluation: bool = False  # evaluation_strategy == "epoch"
    # Featurizing rows: columns, chat template, which tokens carry a loss.
    text_column: str = "text"
    messages_column: str = "messages"
    completion_only_loss: bool = False
    chat_template: str | None = None
    drop_columns: tuple[str, ...] = ()  # ids_to_pop_from_dataset

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.accumulation_steps

    @classmethod
    def from_arguments(cls, args: Any) -> DataSettings:
        """The one place the pipeline's fields are read from TrainingArguments; a
        DataSettings is returned as it is."""
        if isinstance(args, DataSettings):
            return args
        return cls(
            seq_len=args.max_sequence_length,
            global_batch_size=args.total_batch_size,
            accumulation_steps=args.gradient_accumulation_steps,
            eval_batch_size=args.resolved_eval_batch_size,
            seed=args.seed,
            shuffle=args.shuffle_train,
            drop_last=args.drop_last,
            truncation_mode=args.truncation_mode,
            packing=args.packing,
            packing_window=args.packing_window,
            split_long_documents=args.split_long_documents,
            streaming=args.streaming,
            stream_window=args.stream_window,
            fixed_length=args.max_steps > 0,
            epoch_evaluation=args.evaluation_strategy == "epoch",
            text_column=args.text_column,
            messages_column=args.messages_column,
            completion_only_loss=args.completion_only_loss,
            chat_template=args.chat_template,
            drop_columns=tuple(args.ids_to_pop_from_dataset or ()),
        )
