"""Multi-host start-up: `jax.distributed.initialize` from arguments or the environment.

Sources, first match wins:
1. arguments: coordinator_address (+ num_processes, process_id);
2. JAXTRAIN_COORDINATOR_ADDRESS / JAXTRAIN_NUM_PROCESSES / JAXTRAIN_PROCESS_ID;
3. SLURM (SLURM_NTASKS > 1): the first node of the job on a port derived from the job id,
   SLURM_NTASKS processes, SLURM_PROCID (jaxtrain/distributed/slurm.py);
   Cloud TPU pods (TPU_WORKER_HOSTNAMES with several hosts): JAX's own detection.
`distributed="auto"` initialises only when one of these says there is more than one process;
"on" insists (an error if nothing is found), "off" never initialises.

The call is bounded: it runs in a helper thread and a peer that never arrives within
`distributed_timeout_s` raises DistributedError (exit code 2 from the CLI) instead of hanging.
It must happen before anything touches a JAX device.

Once formed, the cluster is watched (parallel/peers.py): a process that dies or hangs for
`peer_timeout_s` ends every other one with one line and exit code 5, and so does one whose
training loop stands still for `step_timeout_s` (when set). For that, process 0
runs the coordination service in a process of its own (parallel/coordinator.py) when the
cluster's address is known, and JAX's own heartbeat timeout is set well above
`peer_timeout_s`, so that the watch, not JAX's C++ abort, ends the survivors. What JAX
0.10.2 offers (jax/_src/distributed.py): `initialization_timeout` (connect),
`heartbeat_timeout_seconds` (default 100: the service declares a silent process dead and
every client then aborts the process, client.h "Terminating process because the JAX
distributed service detected fatal errors"), `shutdown_timeout_seconds` (default 300: the
exit barrier). `jax.distributed.initialize` passes no `missed_heartbeat_callback` to
jaxlib's client, and one passed to jaxlib directly cannot be called (std::bad_cast): the
abort cannot be caught, only pre-empted. Where JAX detects the cluster itself (SLURM
without srun's variables, TPU pods) the service stays inside process 0, whose death then
ends the others with JAX's abort. Ray clusters are not watched here: the Ray driver sees a
dead actor and tears the cluster down itself (distributed/cluster.py).
"""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass
from typing import Any

import jax

from jaxtrain.errors import ArgumentError, DistributedError

# JAX's own default of jax.distributed.initialize(shutdown_timeout_seconds=...).
JAX_SHUTDOWN_TIMEOUT_S = 300
# The coordination service process of process 0 (its stdin pipe must stay open while this
# process lives: its end tells the service that process 0 is gone).
_service: subprocess.Popen | None = None


def jax_heartbeat_timeout(peer_timeout_s: float) -> int:
    """JAX's heartbeat_timeout_seconds for a watch of `peer_timeout_s`: long enough that
    the watch always decides first (JAX would end the survivors with a C++ abort)."""
    return int(2 * peer_timeout_s) + 10


@dataclass(frozen=True)
class ClusterSpec:
    source: str  # "arguments", "environment", "slurm", "tpu"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def _int_env(env: dict[str, str], name: str) -> int | None:
    value = env.get(name)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedError(
            f"environment variable {name}={value!r} must be an integer."
        ) from None


def detect_cluster(settings: Any, env: dict[str, str] | None = None) -> ClusterSpec | None:
    """What the run's RuntimeSettings (config/sections.py; a Ray actor's own namespace of
    their cluster fields) and the environment say about the cluster (None: one process)."""
    env = dict(os.environ) if env is None else env
    if settings.coordinator_address or (settings.num_processes or 1) > 1:
        return ClusterSpec(
            "arguments", settings.coordinator_address, settings.num_processes, settings.process_id
        )
    if env.get("JAXTRAIN_COORDINATOR_ADDRESS"):
        return ClusterSpec(
            "environment",
            env["JAXTRAIN_COORDINATOR_ADDRESS"],
            _int_env(env, "JAXTRAIN_NUM_PROCESSES"),
            _int_env(env, "JAXTRAIN_PROCESS_ID"),
        )
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        from jaxtrain.parallel.slurm_env import slurm_task

        task = slurm_task(env)  # None when srun's per-task variables are missing
        if task is None:
            return ClusterSpec("slurm")  # JAX's own SLURM detection fills in the rest
        return ClusterSpec("slurm", task.coordinator_address, task.num_processes, task.process_id)
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return ClusterSpec("tpu")
    return None


def _is_initialized() -> bool:
    try:
        from jax._src import distributed as _dist

        return _dist.global_state.client is not None
    except Exception:  # private API moved: assume not initialised
        return False


def initialize_distributed(settings: Any, *, watch_peers: bool = True) -> ClusterSpec | None:
    """Form the cluster described by `settings` (as detect_cluster's) or the environment.

    Returns the ClusterSpec used, or None for a single-process run. Idempotent. With
    `watch_peers`, the processes watch each other once the cluster is formed (module
    docstring); Ray's actors pass False.
    """
    mode = settings.distributed
    if mode == "off":
        return None
    spec = detect_cluster(settings)
    if spec is None:
        if mode == "on":
            raise DistributedError(
                "distributed='on' but no cluster was found: pass coordinator_address, "
                "num_processes and process_id, set JAXTRAIN_COORDINATOR_ADDRESS/"
                "JAXTRAIN_NUM_PROCESSES/JAXTRAIN_PROCESS_ID, or run under SLURM / a TPU pod."
            )
        return None
    if _is_initialized():
        return spec
    if spec.source in ("arguments", "environment"):
        missing = [n for n in ("num_processes", "process_id") if getattr(spec, n) is None]
        if not spec.coordinator_address or missing:
            raise DistributedError(
                f"multi-host run from the {spec.source}: coordinator_address="
                f"{spec.coordinator_address!r}, num_processes={spec.num_processes}, process_id="
                f"{spec.process_id}; all three are needed ({', '.join(missing) or 'address'} "
                "missing)."
            )
    kwargs: dict[str, Any] = {}
    if spec.coordinator_address:
        kwargs = dict(
            coordinator_address=spec.coordinator_address,
            num_processes=spec.num_processes,
            process_id=spec.process_id,
        )
    timeout = float(settings.distributed_timeout_s)
    peer_timeout = float(getattr(settings, "peer_timeout_s", 30.0))
    if watch_peers:
        kwargs["heartbeat_timeout_seconds"] = jax_heartbeat_timeout(peer_timeout)
        if spec.coordinator_address and spec.process_id == 0:
            _start_service(spec, kwargs["heartbeat_timeout_seconds"], peer_timeout, timeout)
            # JAX starts a service on process 0 regardless; it gets a port of its own that
            # no client uses, and every client (this one too) talks to the service process.
            kwargs["coordinator_bind_address"] = "127.0.0.1:0"
    outcome: dict[str, BaseException | None] = {}

    def connect() -> None:
        try:
            # JAX aborts the process when its own timeout fires: give it longer than ours.
            jax.distributed.initialize(**kwargs, initialization_timeout=int(timeout) + 120)
            outcome["error"] = None
        except BaseException as err:  # noqa: BLE001 - reported to the caller below
            outcome["error"] = err

    thread = threading.Thread(target=connect, name="jaxtrain-distributed-init", daemon=True)
    thread.start()
    thread.join(timeout)
    where = (
        f"coordinator {spec.coordinator_address}, process {spec.process_id} of {spec.num_processes}"
        if spec.coordinator_address
        else f"{spec.source} cluster detection"
    )
    if thread.is_alive() or outcome.get("error") is not None:
        _stop_service()  # no cluster: its service is not needed for a grace period
    if thread.is_alive():
        raise DistributedError(
            f"jax.distributed.initialize ({where}) did not complete within "
            f"distributed_timeout_s={timeout:g}s: a peer process never arrived or the "
            "coordinator is unreachable. Start every process (same coordinator_address and "
            "num_processes, distinct process_id), check the address/port, or raise "
            "distributed_timeout_s."
        )
    if outcome.get("error") is not None:
        err = outcome["error"]
        raise DistributedError(
            f"jax.distributed.initialize ({where}) failed: {type(err).__name__}: {err}. "
            "Start every process with the same coordinator_address and num_processes and a "
            "distinct process_id, before anything else touches JAX devices."
        ) from err
    if watch_peers:
        _watch(spec, peer_timeout, getattr(settings, "step_timeout_s", None))
    return spec


def _start_service(spec: ClusterSpec, heartbeat_s: int, peer_timeout: float, timeout: float):
    """Process 0: the coordination service in a process of its own (coordinator.py)."""
    global _service
    from jaxtrain.parallel.coordinator import start_coordinator
    from jaxtrain.parallel.peers import beat_interval

    port = str(spec.coordinator_address).rsplit(":", 1)[1]
    # Where JAX would bind it (jax/_src/distributed.py): all addresses, the address's port.
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{port}"
    try:
        _service = start_coordinator(
            bind,
            int(spec.num_processes or 1),
            heartbeat_timeout_s=heartbeat_s,
            shutdown_timeout_s=JAX_SHUTDOWN_TIMEOUT_S,
            # After process 0 dies the others still need the service until their watches
            # have seen its heartbeat stop.
            grace_s=peer_timeout + 2 * beat_interval(peer_timeout) + 5,
            start_timeout_s=timeout,
        )
    except RuntimeError as err:
        raise DistributedError(
            f"process 0 of {spec.num_processes} ({spec.coordinator_address}): {err} Wait "
            "until it is free or choose another port in coordinator_address."
        ) from None


def _stop_service() -> None:
    global _service
    if _service is not None:
        _service.kill()
        _service.wait()
        _service = None


def _watch(spec: ClusterSpec, peer_timeout: float, step_timeout: float | None) -> None:
    from jax._src import distributed as jax_distributed

    from jaxtrain.parallel.peers import start_watch

    # Read from JAX's state, not jax.process_index(): that would start the backend here,
    # before the runtime's later steps (the compilation cache) are set up.
    state = jax_distributed.global_state
    if state.client is None or state.num_processes < 2:
        return
    address = spec.coordinator_address or "the coordinator"
    start_watch(
        state.client,
        state.process_id,
        state.num_processes,
        peer_timeout,
        service=f"the coordination service ({address})",
        step_timeout_s=step_timeout,
        on_clean_exit=_tell_service_clean,
    )


def _tell_service_clean() -> None:
    """Process 0 ends normally: its service may stop as soon as this process is gone."""
    if _service is None or _service.stdin is None:
        return
    try:
        _service.stdin.write("clean\n")
        _service.stdin.flush()
    except OSError:  # the service is already gone
        pass


def gather_json(value: Any) -> list[Any]:
    """Every process's JSON-able `value`, in process order (a collective: all must call it).

    Used for what only each process knows, such as its position in a data stream, which
    process 0 writes into the checkpoint's metadata.
    """
    import json

    import numpy as np

    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64)))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, lengths.reshape(-1))]


# Arguments that may differ between the processes of one run: which one it is, how it shows.
PER_PROCESS_FIELDS = ("process_id", "progress_bar")


def check_same_arguments(arguments: dict[str, Any]) -> None:
    """ArgumentError on every process when the processes of one run were given different
    arguments (a collective: all must call it). Each would train with its own, a learning
    rate per process updating its own shards, and the run would end "completed"."""
    if jax.process_count() == 1:
        return
    mine = {k: v for k, v in arguments.items() if k not in PER_PROCESS_FIELDS}
    every = gather_json(mine)  # JSON round trips: tuples and lists compare alike
    differ = sorted({k for other in every[1:] for k in {*every[0], *other}
                     if other.get(k) != every[0].get(k)})  # fmt: skip
    if differ:
        detail = "; ".join(
            f"{k}: " + ", ".join(f"process {i} {a.get(k)!r}" for i, a in enumerate(every))
            for k in differ[:4]
        )
        more = f" and {len(differ) - 4} more" if len(differ) > 4 else ""
        raise ArgumentError(
            f"the {len(every)} processes of this run were given different arguments "
            f"({detail}{more}); give every process the same configuration and flags."
        )
