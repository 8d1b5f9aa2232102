"""Checks of TrainingArguments on construction: each failure is an ArgumentError naming the
field, the value and how to fix it."""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from jaxtrain.data.collate import TRUNCATION_MODES
from jaxtrain.errors import ArgumentError
from jaxtrain.models.llama import REMAT_POLICIES
from jaxtrain.parallel.batch import check_divisible
from jaxtrain.training.optim import OPTIMIZERS, SCHEDULERS
from jaxtrain.training.stopping import parse_duration

if TYPE_CHECKING:
    from jaxtrain.arguments import TrainingArguments

DTYPES = ("float32", "bfloat16", "float16")
PROGRESS_BARS = ("rich", "tqdm", "json", "none")
EVALUATION_STRATEGIES = ("no", "steps", "epoch")
ON_NAN = ("stop", "skip")
REPORT_TO = ("jsonl", "tensorboard", "wandb", "mlflow")


def _choice(args: TrainingArguments, name: str, options: tuple[str, ...]) -> None:
    value = getattr(args, name)
    if value not in options:
        close = difflib.get_close_matches(str(value), options, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ArgumentError(
            f"TrainingArguments.{name}={value!r} is not supported.{hint} "
            f"Choose one of: {', '.join(options)}."
        )


def _positive(args: TrainingArguments, name: str, *, allow_zero: bool = False) -> None:
    value = getattr(args, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ArgumentError(f"TrainingArguments.{name} must be a number, got {value!r}.")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ArgumentError(f"TrainingArguments.{name} must be {bound}, got {value}.")


def validate_arguments(args: TrainingArguments) -> None:
    _choice(args, "optimizer", OPTIMIZERS)
    _choice(args, "scheduler", SCHEDULERS)
    for name in ("dtype", "param_dtype"):
        if getattr(args, name) is not None:
            _choice(args, name, DTYPES)
    _choice(args, "gradient_checkpointing", REMAT_POLICIES)
    _choice(args, "progress_bar", PROGRESS_BARS)
    _choice(args, "evaluation_strategy", EVALUATION_STRATEGIES)
    _choice(args, "truncation_mode", TRUNCATION_MODES)
    for tracker in args.report_to:
        if tracker not in REPORT_TO:
            close = difflib.get_close_matches(tracker, REPORT_TO, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ArgumentError(
                f"TrainingArguments.report_to: unknown tracker {tracker!r}.{hint} "
                f"Choose from: {', '.join(REPORT_TO)}."
            )
    if not args.learning_rate > 0:
        raise ArgumentError(
            f"TrainingArguments.learning_rate must be > 0, got {args.learning_rate}. "
            "Pass a positive value such as --learning_rate 3e-4."
        )
    for name in ("total_batch_size", "gradient_accumulation_steps", "max_sequence_length"):
        _positive(args, name)
    for name in ("logging_steps", "eval_steps", "num_train_epochs"):
        _positive(args, name)
    for name in ("warmup_steps", "weight_decay", "adam_epsilon"):
        _positive(args, name, allow_zero=True)
    if args.prefetch_batches < 1:  # the loader's background queue holds at least one batch
        raise ArgumentError(
            f"TrainingArguments.prefetch_batches must be >= 1, got {args.prefetch_batches}. "
            "Use 1 for the least read-ahead (one batch prepared while a step runs)."
        )
    check_divisible(  # the one check of every batch split (parallel/batch.py)
        args.total_batch_size,
        args.gradient_accumulation_steps,
        what="TrainingArguments.total_batch_size",
        over="gradient_accumulation_steps",
    )
    if args.max_steps == 0 or args.max_steps < -1:
        raise ArgumentError(
            f"TrainingArguments.max_steps must be > 0, or -1 to train for num_train_epochs; "
            f"got {args.max_steps}."
        )
    for name in ("adam_beta1", "adam_beta2", "momentum", "min_lr_ratio"):
        value = getattr(args, name)
        if not 0 <= value < 1 and not (name == "min_lr_ratio" and value == 1):
            raise ArgumentError(f"TrainingArguments.{name} must lie in [0, 1), got {value}.")
    if not 0 < args.wsd_decay_fraction <= 1:
        raise ArgumentError(
            f"TrainingArguments.wsd_decay_fraction must lie in (0, 1], got {args.wsd_decay_fraction}."
        )
    if args.clip_grad is not None and args.clip_grad < 0:
        raise ArgumentError(
            f"TrainingArguments.clip_grad must be >= 0 or None, got {args.clip_grad}."
        )
    for name in (
        "eval_batch_size",
        "max_eval_batches",
        "save_steps",
        "save_total_limit",
        "weight_distribution_log_steps",
    ):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ArgumentError(
                f"TrainingArguments.{name} must be > 0 or None (disabled), got {value}."
            )
    if args.scheduler == "warmup_cosine" and args.warmup_steps == 0:
        raise ArgumentError(
            "TrainingArguments.scheduler='warmup_cosine' needs warmup_steps > 0. "
            "Set --warmup_steps, or use scheduler 'cosine'."
        )
    _validate_warmup(args)
    if not args.output_dir:
        raise ArgumentError("TrainingArguments.output_dir must be a non-empty path.")
    _validate_data(args)
    _validate_lora(args)
    _choice(args, "on_nan", ON_NAN)
    _positive(args, "max_nan_skips", allow_zero=True)
    if args.save_interval_minutes is not None and not args.save_interval_minutes > 0:
        raise ArgumentError(
            "TrainingArguments.save_interval_minutes must be > 0 or None (disabled), "
            f"got {args.save_interval_minutes}."
        )
    if args.training_time_limit is not None:
        try:
            parse_duration(str(args.training_time_limit))
        except ValueError as err:
            raise ArgumentError(f"TrainingArguments.training_time_limit: {err}") from None
    if args.resume_from is not None and args.overwrite_output_dir:
        raise ArgumentError(
            "TrainingArguments.resume_from and overwrite_output_dir=True contradict each other "
            "(overwriting deletes the run's checkpoints). Drop one of them."
        )


def _validate_lora(args: TrainingArguments) -> None:
    from jaxtrain.models.lora import resolve_targets

    if isinstance(args.lora_rank, bool) or not isinstance(args.lora_rank, int):
        raise ArgumentError(f"TrainingArguments.lora_rank must be an int, got {args.lora_rank!r}.")
    _positive(args, "lora_rank", allow_zero=True)
    _positive(args, "lora_alpha")
    if not 0 <= args.lora_dropout < 1:
        raise ArgumentError(
            f"TrainingArguments.lora_dropout must be in [0, 1), got {args.lora_dropout!r}."
        )
    if isinstance(args.lora_targets, str):  # CLI: --lora_targets attention,mlp
        args.lora_targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    try:
        resolve_targets(list(args.lora_targets or []))
    except ValueError as err:
        raise ArgumentError(f"TrainingArguments.{err}") from None


def _validate_warmup(args: TrainingArguments) -> None:
    """Warmup must leave steps to decay; with max_steps set this is known now (with epochs,
    the Trainer checks it once the dataset gives the number of steps)."""
    if args.max_steps > 0:
        check_warmup(args, args.max_steps, "max_steps")


def check_warmup(args: TrainingArguments, total_steps: int, what: str) -> None:
    """ArgumentError naming warmup_steps and the run's length when the schedule cannot fit."""
    if args.scheduler == "constant":
        return
    fix = (
        f"Lower --warmup_steps below {total_steps} (e.g. --warmup_steps {total_steps // 10}) "
        "or train longer."
    )
    if args.warmup_steps >= total_steps:
        raise ArgumentError(
            f"TrainingArguments.warmup_steps={args.warmup_steps} must be smaller than the run's "
            f"{total_steps} steps ({what}) so the {args.scheduler} schedule has steps to "
            f"decay. {fix}"
        )
    if args.scheduler == "wsd":
        decay = max(1, round(args.wsd_decay_fraction * total_steps))
        if args.warmup_steps + decay > total_steps:
            raise ArgumentError(
                f"TrainingArguments.warmup_steps={args.warmup_steps} plus the wsd decay "
                f"({decay} steps = wsd_decay_fraction * {total_steps}) exceed the run's "
                f"{total_steps} steps ({what}). Lower warmup_steps or wsd_decay_fraction."
            )


def _validate_data(args: TrainingArguments) -> None:
    for name in (
        "packing",
        "split_long_documents",
        "drop_last",
        "completion_only_loss",
        "streaming",
    ):
        if not isinstance(getattr(args, name), bool):
            raise ArgumentError(f"TrainingArguments.{name} must be true or false.")
    if isinstance(args.ids_to_pop_from_dataset, str):
        # CLI: --ids_to_pop_from_dataset a,b
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
        _positive(args, name)
    if (args.packing or args.streaming) and args.max_steps <= 0:
        which = "packing" if args.packing else "streaming"
        raise ArgumentError(
            f"TrainingArguments.{which}=True has no fixed epoch length; set max_steps "
            "(e.g. --max_steps 1000)."
        )
