"""XLA options of the Trainer's compiles (`TrainingArguments.xla_compiler_options`).

On a CPU, the matmuls of a train step run in library kernels; what XLA:CPU compiles with
LLVM are the fused elementwise kernels around them. LLVM's optimisation level 1 instead of
XLA's default 2 compiles those faster, and the step runs as fast (bench/compiler_options.py,
figures in bench/RESULTS.md), so level 1 is the CPU default (config/tables.py CPU_DEFAULTS),
unless the process's XLA_FLAGS sets a level itself. Other platforms keep XLA's own defaults
unless options are given.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.config.tables import cpu_defaults
from jaxtrain.errors import ArgumentError


def resolve_compiler_options(setting: dict[str, Any] | None, platform: str) -> dict[str, Any]:
    """The options every Trainer compile gets: `setting` as given ({} = XLA's defaults), or
    jaxtrain's defaults for `platform` when it is None."""
    if setting is None:
        return cpu_defaults() if platform == "cpu" else {}
    return dict(setting)


def run_compiler_options(setting: dict[str, Any] | None, device: jax.Device) -> dict[str, Any]:
    """The options of every compile of a run on `device`'s platform; options the user set are
    checked now (`check_compiler_options`), before anything is built."""
    options = resolve_compiler_options(setting, device.platform)
    if setting:
        check_compiler_options(options, device)
    return options


def check_compiler_options(options: dict[str, Any], device: jax.Device) -> None:
    """An ArgumentError naming the options when XLA refuses them (an unknown name, a value of
    the wrong type), found by compiling a one-op program with them: milliseconds, before the
    run builds or compiles anything."""
    if not options:
        return
    probe = jax.device_put(jnp.zeros((), jnp.float32), device)
    try:
        jax.jit(lambda x: x + 1).lower(probe).compile(compiler_options=options)
    except Exception as err:  # XLA reports bad options as runtime errors of several types
        raise ArgumentError(
            f"TrainingArguments.xla_compiler_options={options!r}: XLA refused them ({err}). "
            "Use names of XLA's DebugOptions (for example xla_backend_optimization_level) "
            "with values of their type, or None for jaxtrain's defaults."
        ) from err
