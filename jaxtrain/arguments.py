"""TrainingArguments: every knob of a run, validated on construction.

Each field is read somewhere in the code; the docstring of a field says what it does.
Arguments round-trip through YAML/JSON and accept `--field value` overrides from the CLI.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxtrain.errors import ArgumentError
from jaxtrain.models.llama import REMAT_POLICIES
from jaxtrain.training.optim import OPTIMIZERS, SCHEDULERS
from jaxtrain.training.stopping import parse_duration

DTYPES = ("float32", "bfloat16", "float16")
PROGRESS_BARS = ("rich", "tqdm", "json", "none")
EVALUATION_STRATEGIES = ("no", "steps", "epoch")
TRUNCATION_MODES = ("keep_end", "keep_start")
ON_NAN = ("stop", "skip")
REPORT_TO = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclasses.dataclass
class TrainingArguments:
    # Where everything of the run goes: arguments.json, metrics.jsonl, checkpoints/.
    output_dir: str = "runs/jaxtrain"
    # Refuse to write into an output_dir that already holds checkpoints unless True
    # (then the old checkpoints are deleted first).
    overwrite_output_dir: bool = False
    seed: int = 0

    # Optimisation.
    learning_rate: float = 3e-4
    optimizer: str = "adamw"
    scheduler: str = "cosine"
    warmup_steps: int = 0
    # Final learning rate of decaying schedules, as a fraction of learning_rate.
    min_lr_ratio: float = 0.0
    # wsd: fraction of the run spent in the final linear decay.
    wsd_decay_fraction: float = 0.1
    # Decoupled weight decay; never applied to norms and biases (params with ndim < 2).
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    # Momentum of sgd.
    momentum: float = 0.9
    # Global-norm gradient clipping; None or 0 disables it.
    clip_grad: float | None = 1.0

    # Length of the run: max_steps > 0 wins over num_train_epochs.
    num_train_epochs: int = 1
    max_steps: int = -1

    # Global sequences per optimizer update, across devices and micro-batches.
    total_batch_size: int = 32
    # Micro-batches per update; each holds total_batch_size / gradient_accumulation_steps rows.
    gradient_accumulation_steps: int = 1
    # Rows per eval batch; None means the training micro-batch size.
    eval_batch_size: int | None = None
    max_sequence_length: int = 512
    # Which end of an over-long sequence survives truncation.
    truncation_mode: str = "keep_end"
    # Column holding raw text, tokenized with processing_class when input_ids is absent.
    text_column: str = "text"
    shuffle_train: bool = True
    # Batches prepared ahead by a background thread.
    prefetch_batches: int = 2
    # --- data pipeline (jaxtrain/data; validated in _validate_data) ---
    # Pack several documents per row (segment_ids + per-document positions); needs max_steps.
    packing: bool = False
    # Packing places the documents of blocks of this many documents (best-fit decreasing).
    packing_window: int = 1024
    # Packing splits a document longer than a row into row-sized pieces (each its own
    # document); False truncates it by truncation_mode (counted in data/truncated_tokens).
    split_long_documents: bool = True
    # True: an epoch is rows // total_batch_size steps, the shuffled rest waits for another
    # epoch. False: the last batch is completed with masked filler rows, every row is seen.
    drop_last: bool = True
    # Columns removed from every row before featurizing (and before a data_collator).
    ids_to_pop_from_dataset: list[str] | None = None
    # Column of chat rows: a list of {"role", "content"} rendered with the chat template.
    messages_column: str = "messages"
    # Chat rows: learn only the assistant replies (prompt labels -100).
    completion_only_loss: bool = False
    # A Jinja chat template replacing the tokenizer's own.
    chat_template: str | None = None
    # Read dataset_train as a stream (files, datasets.Dataset); needs max_steps.
    streaming: bool = False
    # Streams are shuffled within blocks of this many rows (1 = stream order).
    stream_window: int = 1024

    # Mixed precision: compute in dtype, keep master parameters in param_dtype.
    # None keeps what the model was built with.
    dtype: str | None = None
    param_dtype: str | None = None
    # Rematerialisation policy of each decoder layer.
    gradient_checkpointing: str = "none"

    # LoRA: rank of the adapters (0 = off). Only the adapters are trained, held in the
    # optimizer state and checkpointed; the base weights stay frozen (jaxtrain.models.lora).
    lora_rank: int = 0
    # Adapter scale alpha / rank.
    lora_alpha: float = 16.0
    # Dropout on the adapters' input during training.
    lora_dropout: float = 0.0
    # Projections that get adapters: "attention", "mlp", or names such as q_proj, o_proj.
    lora_targets: list[str] = dataclasses.field(default_factory=lambda: ["attention", "mlp"])

    # Cadences (in optimizer steps).
    logging_steps: int = 10
    evaluation_strategy: str = "steps"
    eval_steps: int = 100
    # Cap on eval batches per evaluation (None = the whole eval set).
    max_eval_batches: int | None = None
    # Periodic checkpoint every save_steps (None = only the final save).
    save_steps: int | None = None
    # Keep at most this many checkpoints (None = keep all).
    save_total_limit: int | None = None
    # Write a checkpoint when training ends.
    save_final: bool = True
    # Also checkpoint when this many minutes passed since the last save (None = off).
    save_interval_minutes: float | None = None
    # Continue from the newest committed checkpoint in output_dir when there is one.
    resume_if_possible: bool = True
    # Resume from this checkpoint (a step directory, or a run directory: its newest one).
    resume_from: str | None = None
    # On resume, restore parameters, step and data position but start a fresh optimizer
    # state (e.g. after changing the optimizer).
    reset_optimizer: bool = False
    # Save and stop cleanly after this much wall time: "2h30m", "1d", "90m", "HH:MM:SS".
    training_time_limit: str | None = None
    # A NaN/Inf loss or gradient: "stop" (error, nothing bad is applied or saved) or "skip"
    # (drop that update and go on, up to max_nan_skips consecutive times).
    on_nan: str = "stop"
    max_nan_skips: int = 10
    progress_bar: str = "rich"

    # Observability (see README "Observability"). Trackers besides metrics.jsonl (always
    # written): any of "tensorboard", "wandb", "mlflow"; on the CLI a comma-separated list.
    report_to: list[str] = dataclasses.field(default_factory=lambda: ["jsonl"])
    # W&B project / MLflow experiment, and the run's name (default: run-<date>-<time>).
    project_name: str = "jaxtrain"
    run_name: str | None = None
    # Log device memory (memory_stats) and host RSS at logging cadence.
    track_memory: bool = False
    # Weight mean/std/min/max/norm per parameter group (and TensorBoard histograms) every
    # this many steps; None = off.
    weight_distribution_log_steps: int | None = None
    # Write report.png and report.html into output_dir when training ends.
    run_report: bool = True
    # Parallelism (README: "Multi-device and multi-host training"). Mesh sizes
    # (dp, fsdp, ep, tp, sp); one entry may be -1 (the remaining devices). CLI: 1,-1,1,1,1.
    sharding_axis_dims: tuple[int, ...] = (1, -1, 1, 1, 1)
    # Logical axis name -> mesh axis, list of axes or None; overrides the default table.
    sharding_rules: dict | None = None
    # [[regex on the parameter path, [mesh axis | list | None per dim]], ...]; first match wins.
    sharding_regex_rules: list | None = None
    # Multi-host: "auto" (when arguments or environment describe a cluster), "on", "off".
    distributed: str = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # Give up (DistributedError, exit code 2) when the cluster is not formed within this time.
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        self.optimizer = self.optimizer.lower()
        if isinstance(self.report_to, str):
            self.report_to = [t.strip() for t in self.report_to.split(",") if t.strip()]
        self.report_to = [str(t).lower() for t in (self.report_to or [])] or ["jsonl"]
        self.scheduler = self.scheduler.lower().replace("-", "_")
        _validate(self)
        from jaxtrain.parallel.options import normalize_parallel_arguments

        normalize_parallel_arguments(self)

    # ----- derived values -----
    @property
    def micro_batch_size(self) -> int:
        return self.total_batch_size // self.gradient_accumulation_steps

    @property
    def time_limit_seconds(self) -> float | None:
        if self.training_time_limit is None:
            return None
        return parse_duration(self.training_time_limit)

    @property
    def resolved_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.micro_batch_size

    def total_steps(self, steps_per_epoch: int) -> int:
        """Number of optimizer updates of the run."""
        if self.max_steps > 0:
            return self.max_steps
        return steps_per_epoch * self.num_train_epochs

    # ----- serialisation -----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "arguments") -> TrainingArguments:
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [k for k in values if k not in known]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, known, n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ArgumentError(
                f"Unknown TrainingArguments field(s) in {source}: {', '.join(hints)}. "
                "Remove them or fix the spelling."
            )
        hints_by_name = typing.get_type_hints(cls)
        coerced = {
            k: coerce_value(hints_by_name[k], v, field=k, source=source) for k, v in values.items()
        }
        return cls(**coerced)

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> TrainingArguments:
        """Read YAML or JSON; overrides win over the file."""
        values = read_config_file(path)
        values.update(overrides)
        return cls.from_dict(values, source=str(path))


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ArgumentError(f"Config file {path} does not exist. Check the path.")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ArgumentError(f"Config file {path} is not valid YAML/JSON: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ArgumentError(f"Config file {path} must hold a mapping of field: value at top level.")
    return data


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def coerce_value(annotation: Any, value: Any, *, field: str, source: str = "arguments") -> Any:
    """Convert `value` (often a CLI string) to the field's annotated type, or explain why not."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce_value(option, value, field=field, source=source)
            except ArgumentError as err:
                errors.append(str(err))
        raise ArgumentError(errors[0] if errors else f"{field}: cannot parse {value!r}")
    if origin is Literal:
        return value
    if (annotation is dict or origin is dict) and isinstance(value, str):
        parsed = yaml.safe_load(value)  # e.g. --model.rope_scaling '{rope_type: llama3, ...}'
        if not isinstance(parsed, dict):
            raise ArgumentError(f"{field} in {source} must be a mapping, got {value!r}.")
        return parsed
    bad = ArgumentError(
        f"{field} in {source} must be {getattr(annotation, '__name__', annotation)}, got {value!r}."
    )
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad
    if annotation is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if annotation is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if annotation is str:
        if isinstance(value, str):
            return value
        raise bad
    return value


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
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ArgumentError(f"TrainingArguments.{name} must be {bound}, got {value}.")


def _validate(args: TrainingArguments) -> None:
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
    if args.total_batch_size % args.gradient_accumulation_steps:
        raise ArgumentError(
            f"TrainingArguments.total_batch_size={args.total_batch_size} is not divisible by "
            f"gradient_accumulation_steps={args.gradient_accumulation_steps}: every micro-batch "
            "must hold the same number of rows. Pick a total_batch_size that is a multiple of "
            "gradient_accumulation_steps."
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
