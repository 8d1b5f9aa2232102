"""One process of the JAX cluster, as a Ray actor: join the cluster, then run the job.

This module imports neither Ray nor JAX at import time: the actor's environment (XLA_FLAGS
for the number of CPU devices, JAX_PLATFORMS) must be in place before JAX starts, and the
job itself is unpickled only after `jax.distributed.initialize`, because unpickling arrays
would touch the devices first (JAX then refuses to join a cluster).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import Any, Protocol

from jaxtrain import interrupts


class JobContext(Protocol):
    """What a job sees of the process it runs in."""

    process_id: int
    num_processes: int
    attempt: int

    def emit(self, kind: str, step: int, data: Any) -> None: ...


class Job(Protocol):
    def run(self, context: JobContext) -> Any: ...


class LocalContext:
    """A job run in this very process (one-process runs, tests): events kept in a list."""

    def __init__(self, attempt: int = 0) -> None:
        self.process_id, self.num_processes, self.attempt = 0, 1, attempt
        self.events: list[tuple[str, int, Any]] = []

    def emit(self, kind: str, step: int, data: Any) -> None:
        self.events.append((kind, step, data))


def node_address() -> str:
    """This node's IP address as other nodes of the Ray cluster reach it."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (never in an actor): the loopback address
        return "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _stop_on_signal(number: int, frame: Any) -> None:
    name = signal.Signals(number).name
    if not interrupts.request_stop(name):
        interrupts.abort("jaxtrain", f"second {name}: aborting at once", number)


class ProcessActor:
    """Body of the Ray actor of one JAX process (wrapped with ray.remote in cluster.py).

    The actor is threaded (max_concurrency=2): `run` occupies one thread for the whole job
    while the driver calls `drain` on the other to stream process 0's events.
    """

    def __init__(self, process_id: int, num_processes: int, attempt: int) -> None:
        self.process_id, self.num_processes, self.attempt = process_id, num_processes, attempt
        self._events: list[tuple[str, int, Any]] = []
        self._lock = threading.Lock()
        # Ray builds the actor on the process's main thread, the one place a handler can be
        # installed: SIGTERM to this process (a preempted node) stops its job as it stops a
        # lone run, after the step, with a save; every process stops at the same step.
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGTERM, signal.SIGINT):
                signal.signal(number, _stop_on_signal)

    def stop(self, signal_name: str) -> None:
        """The launch driver's stop (it was signalled): as a signal to this process."""
        interrupts.request_stop(signal_name)

    def describe(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node": node_address(), "process_id": self.process_id}

    def coordinator_address(self) -> str:
        """Actor 0 picks the coordinator: its own node and a port free there."""
        return f"{node_address()}:{free_port()}"

    def emit(self, kind: str, step: int, data: Any) -> None:
        with self._lock:
            self._events.append((kind, step, data))

    def drain(self) -> list[tuple[str, int, Any]]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def run(self, payload: bytes, coordinator: str | None, timeout_s: float) -> Any:
        if self.num_processes > 1:
            # The same variables a hand-started multi-host run uses (parallel/distributed.py):
            # a Trainer or `jaxtrain train` inside the job finds the cluster already formed.
            os.environ["JAXTRAIN_COORDINATOR_ADDRESS"] = str(coordinator)
            os.environ["JAXTRAIN_NUM_PROCESSES"] = str(self.num_processes)
            os.environ["JAXTRAIN_PROCESS_ID"] = str(self.process_id)
            from jaxtrain.runtime import join_cluster

            join_cluster(str(coordinator), self.num_processes, self.process_id, timeout_s)
        from ray import cloudpickle

        job: Job = cloudpickle.loads(payload)
        if self.process_id == 0:
            return job.run(self)
        # Only process 0 prints (Ray forwards every actor's stdout to the driver); errors
        # and warnings (stderr) of every process still arrive.
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            return job.run(self)
