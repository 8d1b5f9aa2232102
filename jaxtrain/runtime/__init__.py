"""The run's environment, built once: cluster, compilation cache, mesh and plan, XLA options.

A `Runtime` is made from the arguments and the devices in this order, because each step
needs the one before it:

1. the cluster (`jax.distributed.initialize`), before anything touches a JAX device;
2. JAX's persistent compilation cache, before the first compile;
3. the mesh and the sharding plan, over the cluster's devices;
4. the XLA options of every compile, checked on the mesh's platform.

Everything that builds a run takes the runtime it is given: the Trainer
(`Trainer(..., runtime=None)` builds one), a task trainer's reference or teacher, the CLI
commands, the Ray job and the dry run; `jaxtrain serve` takes step 2 alone
(`serving_environment`: its engine runs where the served model's arrays are). This module is
the only caller of the four steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
from jax.sharding import Mesh

from jaxtrain.cache import enable_compilation_cache
from jaxtrain.config.sections import RuntimeSettings
from jaxtrain.errors import ArgumentError
from jaxtrain.parallel.distributed import ClusterSpec, check_same_arguments, initialize_distributed
from jaxtrain.parallel.plan import ShardingPlan
from jaxtrain.runtime.compiler import run_compiler_options

__all__ = ["RUNTIME_FIELDS", "Runtime", "join_cluster", "runtime_for", "serving_environment"]

# The TrainingArguments fields a Runtime is built from (its RuntimeSettings); a run handed a
# runtime must agree with it on each (the runtime's mesh, options and cluster are what the
# run uses).
RUNTIME_FIELDS = tuple(f.name for f in dataclasses.fields(RuntimeSettings))


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where and how a run computes: its mesh and sharding plan, the XLA options of its
    compiles, the cluster it joined and the compilation cache in use."""

    plan: ShardingPlan
    compiler_options: dict[str, Any]
    cluster: ClusterSpec | None = None
    compilation_cache: Path | None = None
    # The settings this runtime was built from (None: built by hand, checked against none).
    settings: RuntimeSettings | None = None

    @classmethod
    def from_arguments(
        cls,
        args: Any,
        devices: Sequence[jax.Device] | None = None,
        *,
        choose_mesh: Callable[[RuntimeSettings, list[jax.Device]], Any] | None = None,
    ) -> Runtime:
        """The four steps of the module docstring, in order, from `args`' RuntimeSettings (or
        a RuntimeSettings); `devices` default to all. `choose_mesh(settings, devices)` ->
        (settings, devices), when given, picks the mesh once the cluster's devices are known
        (a run restored on other devices than it trained on: cli/run_dir.py)."""
        settings = RuntimeSettings.from_arguments(args)
        cluster = _form_cluster(settings)
        if hasattr(args, "to_dict"):  # a run's arguments: every process must have the same
            check_same_arguments(args.to_dict())
        cache = enable_compilation_cache(settings.compilation_cache_dir)
        if choose_mesh is not None:
            settings, devices = choose_mesh(settings, list(devices or jax.devices()))
        plan = ShardingPlan.from_settings(settings, devices)
        options = run_compiler_options(settings.xla_compiler_options, plan.mesh.devices.flat[0])
        return cls(plan, options, cluster, cache, settings)

    @property
    def mesh(self) -> Mesh:
        return self.plan.mesh

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def process_count(self) -> int:
        return jax.process_count()

    @property
    def is_main_process(self) -> bool:
        """Process 0: the one that prints, writes run files and talks to trackers."""
        return self.process_index == 0

    def check_arguments(self, args: Any, owner: str = "the Trainer") -> None:
        """ArgumentError when `args` ask for another environment than this runtime's."""
        if self.settings is None:
            return
        asked = RuntimeSettings.from_arguments(args)
        differ = [n for n in RUNTIME_FIELDS if getattr(asked, n) != getattr(self.settings, n)]
        if differ:
            detail = ", ".join(
                f"{n}={getattr(asked, n)!r} (runtime: {getattr(self.settings, n)!r})"
                for n in differ
            )
            raise ArgumentError(
                f"{owner}'s arguments differ from the runtime it was given: {detail}. Build the "
                "runtime from the same arguments (Runtime.from_arguments(args)), or pass no "
                "runtime and let the trainer build one."
            )


def serving_environment(compilation_cache_dir: str | None) -> Path | None:
    """What a served model needs of this module: JAX's persistent compilation cache ("auto",
    a directory, or None: off), before its first compile, so a restarted server loads its
    warm-up's programs. Returns the directory in use."""
    return enable_compilation_cache(compilation_cache_dir)


def runtime_for(
    args: Any,
    runtime: Runtime | None = None,
    devices: Sequence[jax.Device] | None = None,
    owner: str = "the Trainer",
) -> Runtime:
    """The runtime a trainer runs in: `runtime` when given (checked against `args`), else one
    built from `args` over `devices`."""
    if runtime is None:
        return Runtime.from_arguments(args, devices)
    if devices is not None:
        raise ArgumentError(
            f"{owner} got both devices= and runtime=: the runtime's mesh already fixes the "
            "devices. Pass one of them."
        )
    runtime.check_arguments(args, owner)
    return runtime


def join_cluster(
    coordinator_address: str, num_processes: int, process_id: int, timeout_s: float
) -> ClusterSpec | None:
    """Join a cluster whose shape is known before any arguments are (a Ray actor forms it
    before it unpickles its job); the runtime built later finds it formed."""
    return _form_cluster(
        SimpleNamespace(
            distributed="on",
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            distributed_timeout_s=timeout_s,
        ),
        # Ray's driver watches its actors and tears the cluster down when one dies.
        watch_peers=False,
    )


def _form_cluster(settings: Any, *, watch_peers: bool = True) -> ClusterSpec | None:
    # The one call of jax.distributed.initialize's wrapper: idempotent, bounded in time.
    return initialize_distributed(settings, watch_peers=watch_peers)
