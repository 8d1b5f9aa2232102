"""Which compiler a plan's step is compiled by, and for which devices.

The best figure is the target's own compiler, compiling for devices that are not there:
- TPU (v5e, v5p, v6e): libtpu (`pip install 'jaxtrain[tpu]'`, the libtpu release that
  matches the installed jax) describes a slice from its topology name ("v5e:2x4",
  "v5p:2x2x2"); `jax.experimental.topologies` turns it into compile-only devices, and XLA:TPU
  compiles the step for them on any machine.
- NVIDIA GPUs: the CUDA plugin describes a GPU topology ("1x1x8": slices x hosts x GPUs) from
  the GPU it finds on this machine; with a GPU at hand the step compiles for more of them
  than are attached. Without a GPU (or without the plugin) there is no GPU compiler.
- Otherwise XLA:CPU compiles the step for that many virtual CPU devices. Its buffer
  assignment is an upper bound on an accelerator's: it keeps every layer's gathered weights
  and full-size gradients alive at once, which GPU and TPU schedulers do not (one H100 ran
  the 1.1B campaign step in 34.9 GiB where XLA:CPU planned 72.3, bench/RESULTS.md).

`compile_target` runs in the plan's child process (worker.py), after XLA_FLAGS has given it
the CPU devices to fall back to; it says which compiler it got and, when it fell back, why.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from jaxtrain.errors import ArgumentError

# The plan's accelerator name -> the generation prefix of libtpu's topology names.
TPU_GENERATIONS = {"v5e": "v5e", "v5p": "v5p", "v6e": "v6e"}
GPUS = ("h100", "h200", "a100")
# Attention kernels only XLA:GPU lowers, and what other compilers compile in their place.
STAND_INS = {"cudnn": "blockwise"}
CPU_BOUND_NOTE = (
    "XLA:CPU keeps every layer's gathered weights alive: an upper bound (one H100 used 0.48x "
    "of it, bench/RESULTS.md)"
)


def topology_chips(accelerator: str, topology: str) -> int:
    """Chips of a TPU slice "AxB" (v5e, v6e: 2D) or "AxBxC" (v5p: 3D); an error naming the
    flag otherwise."""
    dims = 3 if accelerator == "v5p" else 2
    if not re.fullmatch(r"\d+(x\d+){" + str(dims - 1) + "}", topology or ""):
        example = "2x2x2" if dims == 3 else "2x4"
        raise ArgumentError(
            f"--topology {topology!r}: a {accelerator} slice is {dims} chip counts joined by "
            f"'x', e.g. --topology {example}."
        )
    return math.prod(int(n) for n in topology.split("x"))


@dataclass(frozen=True)
class CompileTarget:
    """What compiled a plan: `compiler` ("XLA:TPU", "XLA:GPU", "XLA:CPU"), for what, and
    why the target's own compiler was not used when it was not."""

    compiler: str
    platform: str
    description: str
    fallback_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "compiler": self.compiler,
            "platform": self.platform,
            "description": self.description,
            "fallback_reason": self.fallback_reason,
        }


def compile_target(spec: dict[str, Any]) -> tuple[CompileTarget, list[Any]]:
    """The compiler and devices for the plan `spec` ("accelerator", "topology", "devices",
    "compiler": "auto" or "cpu"), in the plan's child process."""
    import jax

    devices = int(spec["devices"])
    accel = spec.get("accelerator", "")
    why = None
    if spec.get("compiler", "auto") == "cpu":
        why = "--compiler cpu"
    elif accel in TPU_GENERATIONS:
        try:
            return _tpu(accel, spec["topology"], devices)
        except Exception as err:  # no libtpu, or one that does not match this jax
            why = _first_line(err, "no TPU compiler")
    elif accel in GPUS:
        try:
            return _gpu(devices, spec.get("per_node") or devices)
        except Exception as err:  # no CUDA plugin, or no GPU to describe
            why = _first_line(err, "no GPU compiler (it needs the CUDA plugin and a GPU)")
    target = CompileTarget(
        "XLA:CPU", "cpu", f"{devices} virtual CPU devices", why or "no compiler for the target"
    )
    return target, jax.devices("cpu")[:devices]


def _tpu(accel: str, topology: str, devices: int) -> tuple[CompileTarget, list[Any]]:
    import importlib.util
    from importlib import metadata

    from jax.experimental import topologies

    if importlib.util.find_spec("libtpu") is None:
        raise ModuleNotFoundError("libtpu is not installed (pip install 'jaxtrain[tpu]')")
    # Read by libtpu when it loads. Compile-only use needs no TPU of this machine's:
    # - a second process (another plan, a test) would fail on libtpu's lockfile;
    # - a machine that is no TPU VM makes it print a dozen lines of warnings about the
    #   accelerator type and worker hostnames it cannot find. The slice compiled is the
    #   topology named, whatever these say (same figures with and without them).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", _accelerator_type(accel, devices))

    name = f"{TPU_GENERATIONS[accel]}:{topology}"
    found = topologies.get_topology_desc(topology_name=name, platform="tpu").devices
    if len(found) != devices:
        raise ArgumentError(f"topology {name} has {len(found)} chips, not {devices}")
    try:
        version = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        version = "unknown version"
    kind = found[0].device_kind
    return CompileTarget("XLA:TPU", "tpu", f"{name} ({kind}, libtpu {version})"), list(found)


def _accelerator_type(accel: str, chips: int) -> str:
    """Cloud TPU's name of a slice: v5e counts chips ("v5litepod-8"), v5p TensorCores (two
    per chip: "v5p-16"), v6e chips ("v6e-8")."""
    return {"v5e": f"v5litepod-{chips}", "v5p": f"v5p-{2 * chips}"}.get(accel, f"v6e-{chips}")


def _gpu(devices: int, per_node: int) -> tuple[CompileTarget, list[Any]]:
    from jax.experimental import topologies

    hosts = max(1, devices // max(per_node, 1))
    shape = f"1x{hosts}x{devices // hosts}"
    found = topologies.get_topology_desc(platform="cuda", topology=shape).devices
    kind = found[0].device_kind
    return CompileTarget("XLA:GPU", "gpu", f"{shape} ({kind}, CUDA plugin)"), list(found)


def _first_line(err: Exception, what: str) -> str:
    text = " ".join(str(err).split())
    return f"{what}: {text[:160]}"
