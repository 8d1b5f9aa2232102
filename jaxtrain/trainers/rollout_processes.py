"""GRPO's rollouts sampled in processes of their own (`rollout_processes` n > 0).

Each process (rollout_worker.py) holds an engine and a copy of the policy. A round's groups
are split into n contiguous shares, one per process, sampled at the same time; their rows
come back in the round's order, so the trainer scores and trains on what one engine would
have sampled (a group's draws depend only on its seed). The policy's graph and its unchanging
part go to a process once; its parameters each time they changed (the weight handoff: from
the trainer's devices to the host, pickled through a socket).

A process that dies (killed, out of memory) is said in one line, started again, and given
the same request: the parameters it sampled from are still here, so the round's completions
are the ones the dead process would have returned, and the run goes on as if nothing had
happened. After `MAX_RESTARTS` deaths in a row the run stops with a RolloutProcessError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxtrain.errors import RolloutProcessError
from jaxtrain.trainers.grpo_sampler import RolloutSampler
from jaxtrain.trainers.rollout_rows import RolloutRows

__all__ = ["MAX_RESTARTS", "RolloutProcesses", "Setup"]

logger = logging.getLogger("jaxtrain.trainers.grpo")
MAX_RESTARTS = 3  # deaths in a row of one process before the run gives up


@dataclasses.dataclass
class Setup:
    """What a rollout process samples with (its RolloutSampler's arguments: `share`, the
    processes sharing each round; the policy's graph and unchanging part, on the host)."""

    settings: Any  # the run's RunSettings (a rollout task's)
    tokenizer: Any
    eos_token_ids: list[int]
    pad_token_id: int
    prompt_sets: list[Any]
    share: int
    routing: tuple[int, int] | None
    graphdef: Any
    rest: Any


class _Worker:
    """One rollout process and its end of the socket; `version`: the parameters it holds."""

    def __init__(self, index: int, setup: Setup):
        ours, theirs = socket.socketpair()
        self.index = index
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jaxtrain.trainers.rollout_worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.connection = Connection(ours.detach())
        self.pid, self.version, self.ready = self.process.pid, -1, False
        self.connection.send(("setup", setup))  # answered once its imports went through

    def answer(self) -> Any:
        """The process's answer to the last request (raises OSError/EOFError if it died)."""
        if not self.ready:  # its answer to the setup comes first
            self._receive()
            self.ready = True
        return self._receive()

    def _receive(self) -> Any:
        kind, value = self.connection.recv()
        if kind == "error":
            raise RolloutProcessError(
                f"rollout process {self.index} (pid {self.pid}) failed while sampling:\n{value}"
            )
        return value

    def death(self) -> str:
        """How the process ended, in words (it is waited for a few seconds)."""
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return "stopped answering (killed)"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            self.connection.send(("stop",))
        self.connection.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class RolloutProcesses:
    """`count` rollout processes sampling as `sampler` (the trainer's, whose settings and
    prompts they copy) would; `roll` is its roll from the given policy."""

    def __init__(self, count: int, sampler: RolloutSampler):
        self.count = count
        self.setup = Setup(sampler.settings, sampler.tokenizer, sampler.eos_token_ids,
                           sampler.pad_token_id, sampler.prompt_sets, count, sampler.routing,
                           graphdef=None, rest=None)  # fmt: skip
        self.workers: list[_Worker] = []
        self.last_send_s = 0.0  # the last weight handoff's seconds (device -> host -> sockets)
        self._sent: list[Any] = []  # the parameter arrays of the current version
        self._version = 0
        self._host_params: Any = None
        self._lock = threading.Lock()  # one round at a time (the background thread and eval)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers]

    def roll(
        self,
        policy: nnx.Module,
        prompt_set: int,
        prompt_rows: np.ndarray,
        group: int,
        seeds: list[int],
    ) -> RolloutRows:
        """The completions of prompt_sets[prompt_set][prompt_rows] (groups of `group` rows
        drawing with `seeds`), sampled from `policy` by the processes, each a share."""
        with self._lock:
            self._load(policy)
            shares = [s for s in np.array_split(np.arange(len(seeds)), self.count) if len(s)]
            asks = [
                (prompt_set, prompt_rows[s[0] * group : (s[-1] + 1) * group], group,
                 [seeds[i] for i in s])
                for s in shares
            ]  # fmt: skip
            for worker, ask in zip(self.workers, asks):
                self._send(worker, ask)
            parts = [self._answer(i, ask) for i, ask in enumerate(asks)]
        return RolloutRows(
            **{
                f.name: None if getattr(parts[0], f.name) is None
                else np.concatenate([getattr(p, f.name) for p in parts])
                for f in dataclasses.fields(RolloutRows)
            }
        )  # fmt: skip

    def close(self) -> None:
        with self._lock:
            for worker in self.workers:
                worker.stop()
            self.workers = []

    # ------------------------------------------------------------ internals
    def _load(self, policy: nnx.Module) -> None:
        """Start the processes (first call) and take the policy's parameters as the current
        version if they are new arrays."""
        graphdef, params, rest = nnx.split(policy, nnx.Param, ...)
        leaves = jax.tree.leaves(params)
        if len(leaves) != len(self._sent) or any(a is not b for a, b in zip(leaves, self._sent)):
            start = time.perf_counter()
            self._host_params = jax.device_get(params)
            self._sent, self._version = leaves, self._version + 1
            self.last_send_s = time.perf_counter() - start
        if not self.workers:
            self.setup = dataclasses.replace(
                self.setup, graphdef=graphdef, rest=jax.device_get(rest)
            )
            self.workers = [_Worker(i, self.setup) for i in range(self.count)]

    def _send(self, worker: _Worker, ask: tuple) -> None:
        """The request, with the parameters if the process does not hold this version."""
        fresh = worker.version != self._version
        start = time.perf_counter()
        try:
            worker.connection.send(("roll", self._host_params if fresh else None, *ask))
        except OSError:
            return  # it died: _answer finds out, restarts it and asks again
        if fresh:
            worker.version = self._version
            self.last_send_s += time.perf_counter() - start

    def _answer(self, index: int, ask: tuple) -> RolloutRows:
        """Worker `index`'s rows for `ask`; a process that died is replaced and asked again."""
        deaths = 0
        while True:
            worker = self.workers[index]
            try:
                return worker.answer()
            except (EOFError, OSError):
                how = worker.death()
                worker.connection.close()
            deaths += 1
            if deaths > MAX_RESTARTS:
                raise RolloutProcessError(
                    f"rollout process {index} died {MAX_RESTARTS + 1} times in a row (last: "
                    f"pid {worker.pid} {how}); the run stops. Look for the cause in the "
                    "process's output above (memory, a signal), or set rollout_processes=0 to "
                    "sample in the trainer's process."
                )
            logger.warning(
                "rollout process %d (pid %d) %s while sampling; a new one samples the same "
                "prompts again from the same parameters (restart %d of at most %d in a row).",
                index, worker.pid, how, deaths, MAX_RESTARTS,
            )  # fmt: skip
            self.workers[index] = _Worker(index, self.setup)
            self._send(self.workers[index], ask)
