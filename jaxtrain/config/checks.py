"""Every check of a run's arguments: each failure is an ArgumentError naming the field, the
value and how to fix it. Checks read; they never change a value (parsing CLI strings into
lists and tuples happens once, before them: `normalized_fields`).

The tables of names are the configuration's own (tables.py), so checking a configuration
imports nothing of the implementation.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import numbers
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxtrain.config.mixture import parse_mixture_weights
from jaxtrain.config.parallel_checks import check_parallel
from jaxtrain.config.tables import (
    DTYPES,
    ELEMENTWISE_KERNELS,
    EVALUATION_STRATEGIES,
    IMAGE_TRUNCATION,
    MIXTURE_EXHAUSTED,
    ON_NAN,
    OPTIMIZERS,
    PROGRESS_BARS,
    QUANTIZATIONS,
    REMAT_POLICIES,
    REPORT_TO,
    SCHEDULERS,
    TRUNCATION_MODES,
    parse_axis_dims,
    parse_duration,
    parse_profile_steps,
    resolve_lora_targets,
)
from jaxtrain.errors import ArgumentError


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


# ------------------------------------------------------------------ parsing
def _split_list(value: Any) -> Any:
    """A CLI comma list ("a,b") as a list; anything else as it is."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _yaml(value: Any, field: str) -> Any:
    if isinstance(value, str):
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ArgumentError(
                f"TrainingArguments.{field}: cannot parse {value!r}: {err}"
            ) from None
    return value


def normalized_fields(args: Any) -> dict[str, Any]:
    """The values of the fields the command line gives as strings, parsed (names lowered,
    comma lists split, the mesh and sharding rules read): applied once, on construction."""
    report_to = _split_list(args.report_to)
    regex = _yaml(args.sharding_regex_rules, "sharding_regex_rules")
    if isinstance(regex, (list, tuple)):
        regex = [
            [e[0], list(e[1])] if isinstance(e, (list, tuple)) and len(e) == 2 else e for e in regex
        ]
    return {
        "optimizer": str(args.optimizer).lower(),
        "scheduler": str(args.scheduler).lower().replace("-", "_"),
        "report_to": [str(t).lower() for t in (report_to or [])] or ["jsonl"],
        "lora_targets": _split_list(args.lora_targets),
        "ids_to_pop_from_dataset": _split_list(args.ids_to_pop_from_dataset),
        "eval_tasks": _split_list(args.eval_tasks),
        "mixture_weights": _yaml(args.mixture_weights, "mixture_weights"),
        "mixture_exhausted": str(args.mixture_exhausted).lower(),
        "sharding_axis_dims": parse_axis_dims(args.sharding_axis_dims),
        "sharding_rules": _yaml(args.sharding_rules, "sharding_rules"),
        "sharding_regex_rules": regex,
        "profile_steps": parse_profile_steps(args.profile_steps),
    }


# ------------------------------------------------------------------ checks
def validate_arguments(args: Any) -> None:
    """The whole configuration: each field's declared type, general fields, then each
    subsystem's."""
    check_field_types(args)
    check_general(args)
    check_optimizer(args)
    check_model(args)
    check_data(args)
    check_mixture(args)
    check_eval_tasks(args)
    check_time_limit(args)
    check_parallel(args)
    check_pruning(args)


def check_field_types(args: Any) -> None:
    """Each field declared int, float, bool or str (or one of them or None) holds one (an int
    where a float is declared too): the command line parses its values by these types, and from
    Python a float where an int is declared (max_steps=3.5) once failed inside the run."""
    for name, kinds in _simple_types(type(args)).items():
        value = getattr(args, name)
        if not any(_is(value, kind) for kind in kinds):
            said = " or ".join(_KIND_NAMES[kind] for kind in kinds)
            said = said.replace("true or false or", "true, false or")
            raise ArgumentError(
                f"{type(args).__name__}.{name} must be {said}, got {value!r} "
                f"({type(value).__name__})."
            )


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               type(None): "None"}  # fmt: skip


def _is(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, kind)


@functools.cache
def _simple_types(cls: type) -> dict[str, tuple[type, ...]]:
    """The fields of `cls` whose declared type is int, float, bool, str or a union of them
    (with None), and those types."""
    hints = typing.get_type_hints(cls)
    simple = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if all(kind in _KIND_NAMES for kind in kinds):
            simple[field.name] = kinds
    return simple


def check_general(args: Any) -> None:
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
    if args.eval_steps == 0:  # a way to say "never", which has its own setting
        raise ArgumentError(
            "TrainingArguments.eval_steps must be > 0, got 0; evaluation_strategy='no' "
            "(--evaluation_strategy no) turns evaluation off."
        )
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
    if args.mu_dtype not in (None, "float32", "bfloat16", "float16"):
        raise ArgumentError(
            f"TrainingArguments.mu_dtype={args.mu_dtype!r}: use bfloat16, float16, float32 or "
            "None (the parameters' dtype)."
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
        "eval_tasks_limit",
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
        output_dir = Path(args.output_dir).absolute()
        resume_from = Path(args.resume_from).absolute()
        if resume_from == output_dir or output_dir in resume_from.parents:
            raise ArgumentError(
                f"TrainingArguments.resume_from={args.resume_from} is inside output_dir and "
                "overwrite_output_dir=True would delete it. Drop one of them (or resume from "
                "a checkpoint of another run)."
            )


def check_optimizer(args: Any) -> None:
    """The optimizer's and schedule's fields."""
    check_choice(args, "optimizer", OPTIMIZERS)
    check_choice(args, "scheduler", SCHEDULERS)
    if args.scheduler == "warmup_cosine" and args.warmup_steps == 0:
        raise ArgumentError(
            "TrainingArguments.scheduler='warmup_cosine' needs warmup_steps > 0. "
            "Set --warmup_steps, or use scheduler 'cosine'."
        )
    # Warmup must leave steps to decay; with max_steps set this is known now (with epochs,
    # the Trainer checks it once the dataset gives the number of steps).
    if args.max_steps > 0:
        check_warmup(args, args.max_steps, "max_steps")


def check_warmup(args: Any, total_steps: int, what: str) -> None:
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


def check_model(args: Any) -> None:
    """The remat policy, scan_layers, the vision tower and the LoRA fields."""
    policy = args.gradient_checkpointing
    if policy not in REMAT_POLICIES:
        close = difflib.get_close_matches(str(policy), REMAT_POLICIES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ArgumentError(
            f"TrainingArguments.gradient_checkpointing={policy!r} is not supported.{hint} "
            f"Choose one of: {', '.join(REMAT_POLICIES)}."
        )
    if args.elementwise_kernels not in ELEMENTWISE_KERNELS:
        raise ArgumentError(f"TrainingArguments.elementwise_kernels={args.elementwise_kernels!r}: "
                            f"choose one of {', '.join(ELEMENTWISE_KERNELS)}.")  # fmt: skip
    rank, alpha = args.lora_rank, args.lora_alpha  # their types: check_field_types
    if rank < 0:
        raise ArgumentError(f"TrainingArguments.lora_rank must be >= 0, got {rank}.")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ArgumentError(f"TrainingArguments.lora_alpha must be a number, got {alpha!r}.")
    if not alpha > 0:
        raise ArgumentError(f"TrainingArguments.lora_alpha must be > 0, got {alpha}.")
    if not 0 <= args.lora_dropout < 1:
        raise ArgumentError(
            f"TrainingArguments.lora_dropout must be in [0, 1), got {args.lora_dropout!r}."
        )
    check_quantization(args)
    if args.lora_targets is None:  # the model's own default (models.lora.default_targets)
        return
    try:
        resolve_lora_targets(list(args.lora_targets))
    except ValueError as err:
        raise ArgumentError(f"TrainingArguments.{err}") from None


def check_quantization(args: Any) -> None:
    """A quantized base needs LoRA (only adapters train on it) and an even block size."""
    quantization = args.quantization
    if quantization is not None:
        check_choice(args, "quantization", QUANTIZATIONS)
        if not args.lora_rank:
            raise ArgumentError(
                f"TrainingArguments.quantization={quantization!r} stores the base frozen and "
                "quantized, so only LoRA adapters can train: set --lora_rank (e.g. 16), or drop "
                "--quantization to fine-tune the float model."
            )
    block = args.quantization_block_size
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2:
        raise ArgumentError(
            f"TrainingArguments.quantization_block_size must be an even integer >= 2 (NF4 "
            f"packs two codes a byte), got {block!r}; 64 is QLoRA's."
        )


def check_data(args: Any) -> None:
    """The data pipeline's fields."""
    check_choice(args, "truncation_mode", TRUNCATION_MODES)
    check_choice(args, "image_truncation", IMAGE_TRUNCATION)
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
    for name in ("stream_window", "packing_window", "images_per_row"):
        check_positive(args, name)
    check_positive(args, "seed", allow_zero=True)  # the data order's and the model's
    if (args.packing or args.streaming) and args.max_steps <= 0:
        which = "packing" if args.packing else "streaming"
        raise ArgumentError(
            f"TrainingArguments.{which}=True has no fixed epoch length; set max_steps "
            "(e.g. --max_steps 1000)."
        )


def check_mixture(args: Any) -> None:
    """The mixture's weights (config/mixture.py) and what a mixture needs of the run."""
    check_choice(args, "mixture_exhausted", MIXTURE_EXHAUSTED)
    if parse_mixture_weights(args.mixture_weights) is None:
        return
    if args.max_steps <= 0:
        raise ArgumentError(
            "TrainingArguments.mixture_weights: a mixture has no fixed epoch length; set "
            "max_steps (e.g. --max_steps 1000)."
        )
    if args.evaluation_strategy == "epoch":
        raise ArgumentError(
            "TrainingArguments.evaluation_strategy='epoch' needs one epoch length, which a "
            "mixture (an epoch per source) does not have; use evaluation_strategy='steps'."
        )


def check_eval_tasks(args: Any) -> None:
    """eval_tasks is a list of task files or names; their files are checked by the Trainer
    (a run directory's arguments must load even where the task files are not)."""
    tasks = args.eval_tasks
    if tasks is None:
        return
    if not isinstance(tasks, list | tuple) or not all(isinstance(t, str) and t for t in tasks):
        raise ArgumentError(
            f"TrainingArguments.eval_tasks must be a list of task YAML paths or task names, "
            f"got {tasks!r}."
        )
    if tasks and args.evaluation_strategy == "no":
        raise ArgumentError(
            "TrainingArguments.eval_tasks are scored at evaluations, which "
            "evaluation_strategy='no' turns off; use evaluation_strategy='steps' (every "
            "eval_steps) or drop eval_tasks."
        )


def check_time_limit(args: Any) -> None:
    """training_time_limit is a duration."""
    if args.training_time_limit is not None:
        try:
            parse_duration(str(args.training_time_limit))
        except ValueError as err:
            raise ArgumentError(f"TrainingArguments.training_time_limit: {err}") from None


def check_pruning(args: Any) -> None:
    """The pruning fields."""
    target = args.pruning_target_sparsity
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 <= target < 1:
        raise ArgumentError(
            f"TrainingArguments.pruning_target_sparsity must lie in [0, 1) (0 = no pruning), "
            f"got {target!r}. E.g. 0.5 prunes half of each targeted matrix."
        )
    for name, least in (("pruning_begin_step", 0), ("pruning_frequency", 1)):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ArgumentError(
                f"TrainingArguments.{name} must be an integer >= {least}, got {value!r}."
            )
    end = args.pruning_end_step
    if end is not None and (
        isinstance(end, bool) or not isinstance(end, int) or end <= args.pruning_begin_step
    ):
        raise ArgumentError(
            f"TrainingArguments.pruning_end_step must be an integer after pruning_begin_step="
            f"{args.pruning_begin_step}, or None (the run's last step); got {end!r}."
        )
    if target and end is not None and args.max_steps > 0 and end > args.max_steps:
        raise ArgumentError(
            f"TrainingArguments.pruning_end_step={end} lies after max_steps={args.max_steps}: "
            "the target sparsity would never be reached. Lower it, or leave it None."
        )
    for pattern in args.pruning_targets or []:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as err:
            raise ArgumentError(
                f"TrainingArguments.pruning_targets: {pattern!r} is not a regular expression "
                f"({err}). Patterns are searched in paths like 'model/layers/0/mlp/down_proj/kernel'."
            ) from None
    if target and args.lora_rank:
        raise ArgumentError(
            "TrainingArguments.pruning_target_sparsity > 0 with lora_rank > 0: LoRA trains only "
            "the adapters, and pruning prunes trained parameters. Use one of them."
        )
