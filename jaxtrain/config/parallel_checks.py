"""The checks of a run's parallel fields: the batch split, the mesh, the sharding rules and
the cluster's processes (config/checks.py runs them with every other check)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from jaxtrain.config.tables import DISTRIBUTED_MODES, MESH_AXES, check_divisible, parse_axis_dims
from jaxtrain.errors import ArgumentError

Device = TypeVar("Device")


def rollout_split(devices: Sequence[Device], r: int) -> tuple[list[Device], list[Device]]:
    """(the devices that train, the engine's) of an online RL run with rollout_devices `r`:
    the engine takes the last r (none when r is 0). The trainer, `jaxtrain plan` and its
    worker all split this way."""
    devices = list(devices)
    if not r:
        return devices, []
    if r >= len(devices):
        raise ArgumentError(
            f"rollout_devices={r} leaves no device to train on ({len(devices)} in all); keep "
            "at least one for training."
        )
    return devices[:-r], devices[-r:]


def _check_axes(rule: Any, where: str) -> None:
    axes = [rule] if isinstance(rule, str) or rule is None else rule
    if not isinstance(axes, (list, tuple)) or any(
        a is not None and a not in MESH_AXES for a in axes
    ):
        raise ArgumentError(
            f"{where}={rule!r}: use a mesh axis of {MESH_AXES}, a list of them, or null."
        )


def check_parallel(args: Any) -> None:
    """The batch split, the mesh, the sharding rules and the cluster's fields."""
    check_divisible(  # the one check of every batch split
        args.total_batch_size,
        args.gradient_accumulation_steps,
        what="TrainingArguments.total_batch_size",
        over="gradient_accumulation_steps",
    )
    parse_axis_dims(args.sharding_axis_dims)
    rules = args.sharding_rules
    if rules is not None:
        if not isinstance(rules, dict):
            raise ArgumentError(
                f"TrainingArguments.sharding_rules must map logical axis names to mesh axes, "
                f"e.g. {{mlp: tp, embed: fsdp}}; got {rules!r}."
            )
        for name, rule in rules.items():
            _check_axes(rule, f"TrainingArguments.sharding_rules[{name!r}]")
    regex = args.sharding_regex_rules
    if regex is not None:
        if not isinstance(regex, (list, tuple)):
            raise ArgumentError(
                "TrainingArguments.sharding_regex_rules must be a list of [pattern, [axis per "
                f'dim]] pairs, e.g. [["mlp/.*kernel$", [fsdp, tp]]]; got {regex!r}.'
            )
        for i, entry in enumerate(regex):
            if not (
                isinstance(entry, (list, tuple))
                and len(entry) == 2
                and isinstance(entry[0], str)
                and isinstance(entry[1], (list, tuple))
            ):
                raise ArgumentError(
                    f"TrainingArguments.sharding_regex_rules[{i}]={entry!r} must be "
                    "[pattern, [mesh axis, list of axes or null per dim]]."
                )
            for rule in entry[1]:
                _check_axes(rule, f"TrainingArguments.sharding_regex_rules[{i}] ({entry[0]!r})")
    if args.distributed not in DISTRIBUTED_MODES:
        raise ArgumentError(
            f"TrainingArguments.distributed={args.distributed!r} is not supported. Choose one "
            f"of: {', '.join(DISTRIBUTED_MODES)}."
        )
    if not args.distributed_timeout_s > 0:
        raise ArgumentError(
            f"TrainingArguments.distributed_timeout_s must be > 0, got {args.distributed_timeout_s}."
        )
    if not args.peer_timeout_s >= 1:
        raise ArgumentError(
            f"TrainingArguments.peer_timeout_s must be >= 1 (seconds), got {args.peer_timeout_s}."
        )
    if args.step_timeout_s is not None and not args.step_timeout_s >= 1:
        raise ArgumentError(
            f"TrainingArguments.step_timeout_s must be >= 1 (seconds) or None (no progress "
            f"watch), got {args.step_timeout_s}; set it above your slowest step."
        )
    if args.num_processes is not None and args.num_processes <= 0:
        raise ArgumentError(
            f"TrainingArguments.num_processes must be > 0, got {args.num_processes}."
        )
    if (
        args.process_id is not None
        and args.num_processes is not None
        and not (0 <= args.process_id < args.num_processes)
    ):
        raise ArgumentError(
            f"TrainingArguments.process_id={args.process_id} must lie in [0, num_processes="
            f"{args.num_processes})."
        )
