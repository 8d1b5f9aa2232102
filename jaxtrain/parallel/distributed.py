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
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import jax

from jaxtrain.errors import DistributedError

DISTRIBUTED_MODES = ("auto", "on", "off")


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


def detect_cluster(args: Any, env: dict[str, str] | None = None) -> ClusterSpec | None:
    """What the arguments and environment say about the cluster (None: one process)."""
    env = dict(os.environ) if env is None else env
    if args.coordinator_address or (args.num_processes or 1) > 1:
        return ClusterSpec(
            "arguments", args.coordinator_address, args.num_processes, args.process_id
        )
    if env.get("JAXTRAIN_COORDINATOR_ADDRESS"):
        return ClusterSpec(
            "environment",
            env["JAXTRAIN_COORDINATOR_ADDRESS"],
            _int_env(env, "JAXTRAIN_NUM_PROCESSES"),
            _int_env(env, "JAXTRAIN_PROCESS_ID"),
        )
    if env.get("SLURM_JOB_ID") and int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        from jaxtrain.distributed.slurm import slurm_task

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


def initialize_distributed(args: Any) -> ClusterSpec | None:
    """Form the cluster described by `args` (TrainingArguments) or the environment.

    Returns the ClusterSpec used, or None for a single-process run. Idempotent.
    """
    mode = args.distributed
    if mode == "off":
        return None
    spec = detect_cluster(args)
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
    timeout = float(args.distributed_timeout_s)
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
    return spec


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
