"""Ray actors forming one JAX cluster, watched by the driver, restarted after a fault.

One attempt: a placement group reserves every process's resources at once (all or nothing,
so a half-scheduled cluster never waits forever), one actor per JAX process starts, actor 0
picks the coordinator address, and every actor runs the same job. The driver waits on all of
them and streams process 0's events. An actor that dies (killed, OOM, node lost) ends the
attempt: every actor is killed and the driver waits, up to `teardown_timeout_s`, until their
processes are gone. The next attempt starts fresh processes (a JAX process cannot join a
second cluster) and the job resumes from the newest committed checkpoint; after
`max_restarts` restarts the driver raises ClusterError naming the process and the cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxtrain import interrupts
from jaxtrain.errors import EXIT_PEER_LOST, first_sentences
from jaxtrain.parallel.distributed import DistributedError

EventSink = Callable[[str, int, Any], None]
_POLL_S = 0.25
# After one process's job raised, how long to look for a peer that died (the real fault).
_DEATH_GRACE_S = 5.0


class ClusterError(DistributedError):
    """The Ray cluster could not run the job: a process died too often, or none could start."""


class ProcessDiedError(ClusterError):
    """A process died and no restart is left: exit 5 as a lost peer, not 2 (bad input)."""

    exit_code = EXIT_PEER_LOST


@dataclasses.dataclass
class ClusterConfig:
    """Where and how many JAX processes run.

    `address`: None starts a local Ray instance (or uses the one this process already
    joined); "auto" or "ray://host:10001" joins an existing cluster.
    `devices_per_process`: on CPU, the number of XLA host devices each process exposes
    (XLA_FLAGS); None keeps what the node has (GPUs/TPUs are what Ray assigns the actor).
    """

    num_processes: int = 1
    devices_per_process: int | None = None
    cpus_per_process: float = 1.0
    gpus_per_process: float = 0.0
    # Other Ray resources per process, e.g. {"TPU": 4}.
    resources_per_process: dict[str, float] | None = None
    # Placement of the processes over nodes: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
    placement_strategy: str = "PACK"
    address: str | None = None
    # Restarts after a process died; each resumes from the newest committed checkpoint.
    max_restarts: int = 0
    # Bound on tearing an attempt down, on reserving resources and on forming the cluster.
    teardown_timeout_s: float = 60.0
    start_timeout_s: float = 300.0
    # Extra environment variables of every process.
    env: dict[str, str] | None = None
    # Ray's session directory when a local instance is started (keep it short: sockets).
    ray_temp_dir: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_processes, int) or self.num_processes < 1:
            raise ClusterError(f"num_processes must be an int >= 1, got {self.num_processes!r}.")
        if self.devices_per_process is not None and self.devices_per_process < 1:
            raise ClusterError(
                f"devices_per_process must be >= 1 or None, got {self.devices_per_process!r}."
            )
        if self.max_restarts < 0:
            raise ClusterError(f"max_restarts must be >= 0, got {self.max_restarts}.")
        strategies = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
        if self.placement_strategy not in strategies:
            raise ClusterError(
                f"placement_strategy={self.placement_strategy!r}; use one of {strategies}."
            )

    def bundle(self) -> dict[str, float]:
        bundle = {"CPU": float(self.cpus_per_process)}
        if self.gpus_per_process:
            bundle["GPU"] = float(self.gpus_per_process)
        bundle.update(self.resources_per_process or {})
        return {k: v for k, v in bundle.items() if v}

    def process_env(self) -> dict[str, str]:
        env = dict(self.env or {})
        if self.devices_per_process is not None:
            kept = re.sub(
                r"--xla_force_host_platform_device_count=\S+",
                "",
                env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")),
            ).split()
            count = f"--xla_force_host_platform_device_count={self.devices_per_process}"
            env["XLA_FLAGS"] = " ".join([*kept, count])
        return env


@dataclasses.dataclass
class Attempt:
    """What happened to one attempt: its processes and, when it failed, who and why."""

    number: int
    processes: list[dict[str, Any]]  # {"pid", "node", "process_id"} per process
    failed_process: int | None = None
    cause: str | None = None


def plain_output() -> None:
    """No ANSI colour codes where the driver's output is not a terminal (a log file, a pipe):
    Ray colours the "(pid=...)" prefix of forwarded lines unless RAY_COLOR_PREFIX=0, and the
    "[repeated 2x across cluster]" of its line deduplication always (RAY_DEDUP_LOGS=0)."""
    import sys

    streams = (sys.stdout, sys.stderr)
    if not all(getattr(s, "isatty", None) and s.isatty() for s in streams):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def ensure_ray(cluster: ClusterConfig) -> None:
    """Join the cluster at `cluster.address`, or start a local Ray instance."""
    import ray

    if ray.is_initialized():
        return
    plain_output()
    if cluster.address is not None:
        ray.init(address=cluster.address, log_to_driver=True)
        return
    # A local instance needs no token and must not write into the home directory.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs: dict[str, Any] = {"include_dashboard": False}
    if cluster.ray_temp_dir:
        kwargs["_temp_dir"] = cluster.ray_temp_dir
    ray.init(**kwargs)


def _short_cause(err: BaseException) -> str:
    text = str(err)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = [line for line in lines if "exit" in line.lower() or "killed" in line.lower()]
    picked = detail[0] if detail else (lines[0] if lines else type(err).__name__)
    return f"{type(err).__name__}: {first_sentences(picked, 200)}"


class _ProcessLost(Exception):
    def __init__(self, process_id: int, cause: str) -> None:
        super().__init__(process_id, cause)
        self.process_id, self.cause = process_id, cause


class ProcessGroup:
    """The actors of one attempt."""

    def __init__(self, cluster: ClusterConfig, attempt: int) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from jaxtrain.distributed.worker import ProcessActor

        self.cluster, self.attempt = cluster, attempt
        n = cluster.num_processes
        self.placement = placement_group([cluster.bundle()] * n, cluster.placement_strategy)
        self.actors: list[Any] = []
        self.processes: list[dict[str, Any]] = []
        ready, _ = ray.wait([self.placement.ready()], timeout=cluster.start_timeout_s)
        if not ready:
            raise ClusterError(
                f"Ray could not reserve {n} x {cluster.bundle()} within "
                f"start_timeout_s={cluster.start_timeout_s:g}s (cluster resources: "
                f"{ray.cluster_resources()}). Lower num_processes or the per-process "
                "resources, or add nodes."
            )
        remote = ray.remote(ProcessActor)
        for index in range(n):
            options = dict(
                num_cpus=cluster.cpus_per_process,
                num_gpus=cluster.gpus_per_process,
                resources=cluster.resources_per_process or {},
                max_restarts=0,  # restarts are whole-cluster attempts, decided here
                max_concurrency=3,  # `drain` and `stop` run beside `run`
                runtime_env={"env_vars": cluster.process_env()},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement, placement_group_bundle_index=index
                ),
            )
            self.actors.append(remote.options(**options).remote(index, n, attempt))
        try:
            self.processes = ray.get(
                [a.describe.remote() for a in self.actors], timeout=cluster.start_timeout_s
            )
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(
                f"the {n} Ray actors did not start within start_timeout_s="
                f"{cluster.start_timeout_s:g}s."
            ) from None

    def run(self, payload: bytes, on_event: EventSink | None) -> list[Any]:
        """Every process's job result, in process order; raises _ProcessLost on a death."""
        import ray

        coordinator = None
        if len(self.actors) > 1:
            coordinator = ray.get(
                self.actors[0].coordinator_address.remote(), timeout=self.cluster.start_timeout_s
            )
        refs = [
            a.run.remote(payload, coordinator, self.cluster.start_timeout_s) for a in self.actors
        ]
        index_of = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        with _DriverSignals() as signals:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
                if signals.take():  # every process finishes its step, saves and exits
                    for actor in self.actors:
                        actor.stop.remote(signals.received)
                self._forward(on_event)
                for ref in ready:
                    results[index_of[ref]] = self._result(ref, index_of[ref], pending, index_of)
        self._forward(on_event)
        return results

    def _result(self, ref: Any, index: int, pending: list[Any], index_of: dict) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as err:
            raise _ProcessLost(index, _short_cause(err)) from err
        except ray.exceptions.RayTaskError as err:
            # A peer's death often surfaces first as an error in a survivor's collective:
            # the dead process is the fault to report (and to restart from), if there is one.
            deadline = time.monotonic() + _DEATH_GRACE_S
            while pending and time.monotonic() < deadline:
                ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0.5)
                for other in ready:
                    try:
                        ray.get(other)
                    except ray.exceptions.RayActorError as death:
                        raise _ProcessLost(index_of[other], _short_cause(death)) from death
                    except ray.exceptions.RayTaskError:
                        pass
                    pending.remove(other)
            raise err.as_instanceof_cause() from None

    def _forward(self, on_event: EventSink | None) -> None:
        """Process 0's events since the last call, handed to `on_event` on the driver."""
        if on_event is None or not self.actors:
            return
        import ray

        try:
            events = ray.get(self.actors[0].drain.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return  # its death is reported by its run() result
        for kind, step, data in events:
            on_event(kind, step, data)

    def teardown(self) -> None:
        """Kill every actor and wait (bounded) until their processes are gone."""
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)  # a dead actor's kill is a no-op
        ray.util.remove_placement_group(self.placement)
        here = _this_node()
        local = [p["pid"] for p in self.processes if p.get("node") == here]
        deadline = time.monotonic() + self.cluster.teardown_timeout_s
        while local and time.monotonic() < deadline:
            local = [pid for pid in local if _alive(pid)]
            if local:
                time.sleep(0.1)
        for pid in local:  # Ray did not reap it in time: this node's process, ours to end
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(pid, signal.SIGKILL)


class _DriverSignals:
    """SIGINT/SIGTERM to the launch's driver while its job runs: the stop is passed on to
    every process (a lone run's save-and-stop, at one step); a second signal ends the driver
    at once (Ray then ends its actors)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._passed_on = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _DriverSignals:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame: Any) -> None:
        name = signal.Signals(number).name
        if self.received is not None:
            import ray

            try:  # a local Ray instance would outlive an exit that skips its atexit shutdown
                ray.shutdown()
            finally:
                interrupts.abort(
                    "jaxtrain launch", f"second {name}: stopped without saving", number
                )
        self.received = name
        print(f"jaxtrain launch: {name}: every process saves after its step and stops", flush=True)

    def take(self) -> bool:
        """True once, after the first signal."""
        if self.received is None or self._passed_on:
            return False
        self._passed_on = True
        return True


def _this_node() -> str:
    from jaxtrain.distributed.worker import node_address

    return node_address()


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_on_cluster(
    make_job: Callable[[int], Any],
    cluster: ClusterConfig,
    *,
    on_event: EventSink | None = None,
    attempts: list[Attempt] | None = None,
    every_process: bool = False,
) -> Any:
    """Run `make_job(attempt)` on every process; process 0's result (with `every_process`,
    the list of every process's result, in process order).

    Restarts after a process death up to `cluster.max_restarts` times; `attempts` (a list)
    receives one Attempt per try. A job that raises without any process dying is not
    retried: its exception is re-raised here (same type).
    """
    from ray import cloudpickle

    ensure_ray(cluster)
    record = attempts if attempts is not None else []
    for number in range(cluster.max_restarts + 1):
        payload = cloudpickle.dumps(make_job(number))
        group = ProcessGroup(cluster, number)
        record.append(Attempt(number, list(group.processes)))
        try:
            results = group.run(payload, on_event)
            return results if every_process else results[0]
        except _ProcessLost as lost:
            record[-1].failed_process, record[-1].cause = lost.process_id, lost.cause
            if on_event is not None and number < cluster.max_restarts:  # a restart follows
                on_event("restart", -1, {"attempt": number, "process": lost.process_id})
        finally:
            group.teardown()
    last = record[-1]
    where = last.processes[last.failed_process] if last.processes else {}
    raise ProcessDiedError(
        f"process {last.failed_process} of {cluster.num_processes} (pid {where.get('pid')} on "
        f"node {where.get('node')}) died: {last.cause.rstrip('.')}. The job ran "
        f"{len(record)} time(s) and max_restarts={cluster.max_restarts} is exhausted. Check "
        "that process's memory and logs, or raise max_restarts; the run resumes from its "
        "newest committed checkpoint."
    )
