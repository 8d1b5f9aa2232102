"""The names a setting may take, and the pure parsers of structured values.

One home for each table: the configuration checks against it and the implementation that
gives each name its meaning (an optimizer's constructor, a remat policy's jax.checkpoint
policy, a mesh axis) reads the same tuple.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from jaxtrain.errors import ArgumentError, MeshError

DTYPES = ("float32", "bfloat16", "float16")
PROGRESS_BARS = ("rich", "tqdm", "json", "none")
EVALUATION_STRATEGIES = ("no", "steps", "epoch")
ON_NAN = ("stop", "skip")
REPORT_TO = ("jsonl", "tensorboard", "wandb", "mlflow")

# XLA options of every Trainer compile on a CPU (runtime/compiler.py) and of a model's eager
# initialisers (models/layers.py): LLVM level 1 compiles the fused kernels around the library
# matmuls faster, and the step runs as fast.
CPU_DEFAULTS = {"xla_backend_optimization_level": 1}


def cpu_defaults() -> dict[str, int]:
    """CPU_DEFAULTS less the options the process's XLA_FLAGS sets itself: a flag the user gave
    (`XLA_FLAGS=--xla_backend_optimization_level=0`, faster compiles for short runs and tests)
    wins over jaxtrain's default."""
    flags = os.environ.get("XLA_FLAGS", "")
    return {k: v for k, v in CPU_DEFAULTS.items() if f"--{k}=" not in flags}


# training/optim.py builds each of these.
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd", "muon")
SCHEDULERS = ("constant", "linear", "cosine", "warmup_cosine", "wsd")

# models/layer_scan.py maps each to a jax.checkpoint policy of a decoder layer.
REMAT_POLICIES = ("none", "nothing_saveable", "dots_saveable", "everything_saveable")
# How a decoder layer's elementwise work runs (models/elementwise.py).
ELEMENTWISE_KERNELS = ("xla", "pallas", "interpret")
# Decoder layers under jax.lax.scan (models/layer_scan.py): the models' default, and
# TrainingArguments.scan_layers' when unset except for a quantized base (there it is on: one
# layer dequantized at a time). Off: on XLA:CPU the scanned step ran at 0.8x the loop's
# tokens/s and compiled no faster at 32 layers (bench/RESULTS.md, 2026-11-29).
SCAN_LAYERS_DEFAULT = False

# jaxtrain/quantization: how a frozen base may be stored.
QUANTIZATIONS = ("nf4", "int8")

# data/collate.py: which end of an over-long row survives.
TRUNCATION_MODES = ("keep_start", "keep_end")
# What a row with images becomes when truncation would cut an image (data/vision.py).
IMAGE_TRUNCATION = ("error", "drop")

# data/mixture.py: what a mixture does when one of its sources runs out of rows.
MIXTURE_EXHAUSTED = ("restart", "stop")

# parallel/mesh.py: the mesh's axes, in the order of sharding_axis_dims.
MESH_AXES = ("dp", "fsdp", "ep", "tp", "sp")
DISTRIBUTED_MODES = ("auto", "on", "off")

# models/lora.py: the groups of `lora_targets` and the projection names of every family
# (Llama's fused qkv_proj / gate_up_proj, GPT-2's attn.c_attn, ViT's qkv ...).
LORA_GROUPS: dict[str, tuple[str, ...]] = {
    "attention": ("qkv_proj", "o_proj", "attn.c_attn", "attn.c_proj", "qkv", "out"),
    "mlp": ("gate_up_proj", "down_proj", "mlp.c_fc", "mlp.c_proj", "fc1", "fc2"),
}
# Hugging Face names of the parts of a fused projection, in the order of its fused axis.
FUSED_PART_NAMES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "qkv": ("query", "key", "value"),
}
_PROJECTIONS = {n for names in LORA_GROUPS.values() for n in names}
_PROJECTIONS |= {n.split(".")[-1] for n in _PROJECTIONS}  # c_attn, c_proj, c_fc
_PARTS = {part for parts in FUSED_PART_NAMES.values() for part in parts}
# Every name `lora_targets` may hold (the model decides which of them it has).
LORA_TARGETS: tuple[str, ...] = tuple(sorted(set(LORA_GROUPS) | _PROJECTIONS | _PARTS))


def resolve_lora_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """The targets with groups expanded (projection path ends and part names), checked
    against every model family's names; ValueError naming the unknown ones."""
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise ValueError(
            f"lora_targets {list(targets)!r}: unknown {unknown!r}; use some of {list(LORA_TARGETS)}"
        )
    return tuple(dict.fromkeys(n for t in targets for n in LORA_GROUPS.get(t, (t,))))


def parse_axis_dims(value: object) -> tuple[int, ...]:
    """Accept (1, -1, 1, 1, 1), [1, -1, ...] or the CLI string "1,-1,1,1,1" / "(1,-1,1,1,1)"."""
    if isinstance(value, str):
        text = value.strip().strip("()[]")
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            value = [int(p) for p in parts]
        except ValueError:
            raise MeshError(
                f"sharding_axis_dims={value!r} must be {len(MESH_AXES)} integers "
                f"{MESH_AXES}, e.g. 1,-1,1,1,1."
            ) from None
    if not isinstance(value, Sequence) or isinstance(value, bytes):
        raise MeshError(
            f"sharding_axis_dims must be a sequence of {len(MESH_AXES)} integers "
            f"{MESH_AXES}, got {value!r}."
        )
    dims = tuple(value)
    if len(dims) != len(MESH_AXES) or not all(_is_int(d) for d in dims):
        raise MeshError(
            f"sharding_axis_dims={dims!r} must hold exactly {len(MESH_AXES)} integers, one per "
            f"mesh axis {MESH_AXES}; use -1 for at most one of them (the remaining devices)."
        )
    dims = tuple(int(d) for d in dims)
    if any(d == 0 or d < -1 for d in dims):
        raise MeshError(
            f"sharding_axis_dims={dims}: every entry must be a positive size or -1, got "
            f"{dict(zip(MESH_AXES, dims, strict=True))}."
        )
    if dims.count(-1) > 1:
        named = [a for a, d in zip(MESH_AXES, dims, strict=True) if d == -1]
        raise MeshError(
            f"sharding_axis_dims={dims} has -1 for {named}; only one axis may take "
            "'the remaining devices'. Give the others explicit sizes."
        )
    return dims


_STEP_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_profile_steps(value: object) -> list[int] | None:
    """profile_steps as [first, last]: from "10-12", "10", [10, 12] or [10]; None stays."""
    if value is None:
        return None
    if isinstance(value, str):
        match = _STEP_RANGE.match(value)
        if match is None:
            raise _bad_profile_steps(value)
        value = [int(match.group(1)), int(match.group(2) or match.group(1))]
    if not isinstance(value, Sequence) or len(value) not in (1, 2):
        raise _bad_profile_steps(value)
    if not all(_is_int(v) for v in value) or not 1 <= int(value[0]) <= int(value[-1]):
        raise _bad_profile_steps(value)
    return [int(value[0]), int(value[-1])]


def _bad_profile_steps(value: object) -> ArgumentError:
    return ArgumentError(
        f"TrainingArguments.profile_steps={value!r} must be [first, last] with "
        "1 <= first <= last (the step numbers the log shows), e.g. [10, 12] or on the command "
        "line --profile_steps 10-12."
    )


def _is_int(value: object) -> bool:
    """An integer that is not a bool (numpy integers too, without importing numpy)."""
    if isinstance(value, bool):
        return False
    try:
        return int(value) == value and hasattr(value, "__index__")  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*([dhms])")
_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as "2h30m", "1d", "90m", "45s", "1.5h", "01:30:00" or
    "1-12:00:00" (SLURM's days-hours:minutes:seconds).

    A bare number is refused: "90" could mean seconds or minutes, and guessing wrong stops a
    run at the wrong time.
    """
    value = text.strip().lower().replace(" ", "")
    clock = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d{1,2})(?::(\d{1,2}))?", value)
    if clock:
        days, first, second, third = clock.groups()
        hours, minutes, seconds = (first, second, third) if third else (0, first, second)
        return int(days or 0) * 86400.0 + int(hours) * 3600.0 + int(minutes) * 60.0 + int(seconds)
    parts = _DURATION_PART.findall(value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise ValueError(
            f"{text!r} is not a duration. Write it with units, e.g. '2h30m', '1d', '90m', "
            "'45s', or as 'HH:MM:SS'."
        )
    total = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    if total <= 0:
        raise ValueError(f"{text!r} is not a positive duration.")
    return total


def check_divisible(rows: int, parts: int, *, what: str, over: str, hint: str = "") -> int:
    """rows // parts, or an ArgumentError naming both numbers and the fix.

    Every split of a batch is checked here, with one error type: micro-batches
    (gradient_accumulation_steps), hosts (process_count), data-parallel devices (dp*fsdp)
    and sequence shards (sp). `hint` adds another way out, e.g. " (or change ...)".
    """
    if rows <= 0 or parts <= 0:
        raise ArgumentError(f"{what}={rows} and {over}={parts} must both be positive.")
    if rows % parts:
        raise ArgumentError(
            f"{what}={rows} is not divisible by {over}={parts}: it is split into {parts} equal "
            f"parts. Make {what} a multiple of {parts}{hint}."
        )
    return rows // parts
