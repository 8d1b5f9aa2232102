"""Checks of TrainingArguments on construction: each failure is an ArgumentError naming the
field, the value and how to fix it."""

from __future__ import annotations

import difflib
import importlib
from typing import TYPE_CHECKING, Any

from jaxtrain.errors import ArgumentError

if TYPE_CHECKING:
    from jaxtrain.arguments import TrainingArguments

DTYPES = ("float32", "bfloat16", "float16")
PROGRESS_BARS = ("rich", "tqdm", "json", "none")
EVALUATION_STRATEGIES = ("no", "steps", "epoch")
ON_NAN = ("stop", "skip")
REPORT_TO = ("jsonl", "tensorboard", "wandb", "mlflow")

# Fields whose values a subsystem defines (an optimizer's name, a remat policy, a mesh shape,
# a truncation mode, a duration, LoRA targets) are checked by that subsystem's own
# `check_arguments(args)`, named here and imported only when arguments are checked: the
# configuration imports nothing of the implementation, and each table has one home.
SUBSYSTEM_CHECKS = (
    "jaxtrain.training.optim",  # optimizer, scheduler, warmup against the run's length
    "jaxtrain.models.fields",  # gradient_checkpointing, lora_*
    "jaxtrain.data.fields",  # truncation_mode, packing, streaming, columns, chat template
    "jaxtrain.training.stopping",  # training_time_limit
    "jaxtrain.parallel.options",  # batch split, mesh, sharding rules, cluster
    "jaxtrain.training.pruning",  # pruning_*
)


def check_choice(args: Any, name: str, options: tuple[str, ...]) -> None:
    """ArgumentError naming the field, the closest option and all of them."""
    value = getattr(args, name)
    if value not in options:
        close = difflib.get_close_matches(str(value), options, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ArgumentError(
            f"TrainingArguments.{name}={value!r} is not supported.{hint} "
            f"Choose one of: {', '.join(options)}."
        )


def check_positive(args: Any, name: str, *, allow_zero: bool = False) -> None:
    value = getattr(args, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ArgumentError(f"TrainingArguments.{name} must be a number, got {value!r}.")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ArgumentError(f"TrainingArguments.{name} must be {bound}, got {value}.")


def validate_arguments(args: TrainingArguments) -> None:
    """The configuration's own checks, then each subsystem's (SUBSYSTEM_CHECKS)."""
    for name in ("dtype", "param_dtype"):
        if getattr(args, name) is not None:
            check_choice(args, name, DTYPES)
    check_choice(args, "progress_bar", PROGRESS_BARS)
    check_choice(args, "evaluation_strategy", EVALUATION_STRATEGIES)
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
        check_positive(args, name)
    for name in ("logging_steps", "eval_steps", "num_train_epochs"):
        check_positive(args, name)
    for name in ("warmup_steps", "weight_decay", "adam_epsilon"):
        check_positive(args, name, allow_zero=True)
    if args.prefetch_batches < 1:  # the loader's background queue holds at least one batch
        raise ArgumentError(
            f"TrainingArguments.prefetch_batches must be >= 1, got {args.prefetch_batches}. "
            "Use 1 for the least read-ahead (one batch prepared while a step runs)."
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
    if not args.output_dir:
        raise ArgumentError("TrainingArguments.output_dir must be a non-empty path.")
    check_choice(args, "on_nan", ON_NAN)
    check_positive(args, "max_nan_skips", allow_zero=True)
    if args.save_interval_minutes is not None and not args.save_interval_minutes > 0:
        raise ArgumentError(
            "TrainingArguments.save_interval_minutes must be > 0 or None (disabled), "
            f"got {args.save_interval_minutes}."
        )
    if args.resume_from is not None and args.overwrite_output_dir:
        raise ArgumentError(
            "TrainingArguments.resume_from and overwrite_output_dir=True contradict each other "
            "(overwriting deletes the run's checkpoints). Drop one of them."
        )

    for module in SUBSYSTEM_CHECKS:
        importlib.import_module(module).check_arguments(args)
