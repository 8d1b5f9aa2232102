"""Noticing a lost peer in a multi-host run, and ending this process with one line.

When one process of a `jax.distributed` cluster dies (SIGKILL, OOM, a lost host) or hangs
(SIGSTOP, a stuck kernel), the others wait inside a collective that never completes. JAX
itself only ends them after its own heartbeat timeout (`heartbeat_timeout_seconds`, 100 s
by default) with a C++ fatal error and a stack trace. Here every process keeps a heartbeat
of its own in the coordination service's key-value store and watches the others':

- a peer whose heartbeat has not moved for `peer_timeout_s` is lost;
- a peer that ended on an error (an uncaught exception, a jaxtrain error in the command
  line) says so; a process whose own collective then breaks ends naming it (`fail`), one
  still waiting gives up on it `peer_timeout_s` later;
- a peer that ended normally (its exit hooks ran without an error) is never lost: the
  process that finishes first does not take down one still writing its report;
- when the service itself stops answering for `peer_timeout_s`, the cluster is lost;
- with a progress watch (`step_timeout_s`), a process that is alive (it beats) but whose
  training loop has not moved past a step for that long is stuck (parallel/progress.py).

A process whose own collective fails (Gloo: "Connection reset by peer" when a peer died
mid-transfer) waits for the watch's verdict on its peers (`fail`) instead of reporting the
collective's error: the dead peer is the cause, and the line names it.

On a loss the watchdog prints one line (who was lost and why, and the newest committed
checkpoint a restart resumes from) and ends the process with EXIT_PEER_LOST. It calls
`os._exit`: the main thread is usually blocked inside a collective (a C++ call of XLA's
CPU/GPU runtime) that no Python exception can interrupt, and exit hooks would wait on the
same lost peer (Orbax's background commit, JAX's shutdown barrier). Whatever the lost run
was writing stays an uncommitted `<step>.orbax-checkpoint-tmp*` directory, which no
restore reads and the next run's first save removes (checkpointing/files.py).

The beat is two small RPCs per interval (at most 1 s) in a background thread; the
training step never waits for it. Python's GIL is the one shared resource: a single C call
that holds it for longer than `peer_timeout_s` makes its process look hung.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxtrain.errors import EXIT_CRASH, EXIT_PEER_LOST, TrainingInterrupted
from jaxtrain.parallel.progress import Position, ProgressBoard

_PREFIX = "jaxtrain/peers/"
_BEAT, _INFO, _LEFT = "beat", "info", "left"  # keys: jaxtrain/peers/<kind>/<process>
# A beat's value is "<count> <position>": the count changes every beat, the position is the
# training loop's (progress.Position, from note_progress).


def beat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats: a tenth of the timeout, between 0.1 s and 1 s."""
    return min(1.0, max(0.1, timeout_s / 10))


class PeerWatch:
    """The heartbeat and watchdog of process `process_id` of `num_processes`.

    `client` is JAX's distributed runtime client (its key_value_set / key_value_dir_get).
    Decisions are taken in `check`, from clocks of this process only (no clock is compared
    across hosts), so they can be tested without threads.
    """

    def __init__(
        self,
        client: Any,
        process_id: int,
        num_processes: int,
        timeout_s: float,
        *,
        service: str = "the coordination service",
        step_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        end: Callable[[str], None] | None = None,
    ):
        self.client, self.process_id, self.num_processes = client, process_id, num_processes
        self.timeout_s, self.service, self.clock = float(timeout_s), service, clock
        self.step_timeout_s = step_timeout_s
        self._end = end or end_process  # given the line; tests record it instead
        self.interval = beat_interval(self.timeout_s)
        # A beat is seen up to an interval late and judged up to an interval later: this
        # silence keeps the whole reaction within timeout_s.
        self.silence_s = self.timeout_s - 2 * self.interval
        self.checkpoints: Path | None = None  # the run's checkpoints directory, once known
        # Its committed steps, oldest first (checkpointing.files.committed_steps, handed in
        # by the training loop: this layer does not import checkpointing).
        self.committed_steps: Callable[[Path], list[int]] = lambda root: []
        self._count = 0
        now = clock()
        self._last_answer = now  # the service's last answer to this process
        # Per peer: (last beat value seen, when it was first seen); the start counts as one.
        self._beats: dict[int, tuple[str | None, float]] = {p: (None, now) for p in self._peers()}
        # Per peer: a time its last beat value was certainly published after (module
        # docstring of `fail`); None until two reads have seen it change.
        self._published_after: dict[int, float | None] = {p: None for p in self._peers()}
        self._read_started: float | None = None  # when the last read of the store began
        self.progress = ProgressBoard(num_processes, step_timeout_s, now)  # this one's too
        self._errors: dict[int, float] = {}  # peer -> when its error was first seen
        self._hosts: dict[int, str] = {}
        self._left: dict[int, str] = {}
        self._leaving: str | None = None  # "clean" or "error" once this process is ending
        self.exit_code = EXIT_CRASH  # this process's own, once it ends on an error
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _peers(self) -> list[int]:
        return [p for p in range(self.num_processes) if p != self.process_id]

    # ------------------------------------------------------------------ the two threads
    def start(self) -> PeerWatch:
        """Publish this process's host, then beat and judge in two daemon threads (a beat
        can block while the service is unreachable; the judge never calls it)."""
        self._call(
            self.client.key_value_set,
            f"{_PREFIX}{_INFO}/{self.process_id}",
            f"host {socket.gethostname()}, pid {os.getpid()}",
            allow_overwrite=True,
        )
        for name, target in (("beat", self._beat_loop), ("watch", self._judge_loop)):
            thread = threading.Thread(target=target, name=f"jaxtrain-peer-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            self.beat()
            self._stop.wait(self.interval)

    def _judge_loop(self) -> None:
        woke = self.clock()
        while not self._stop.wait(self.interval):
            slept, woke = self.clock() - woke, self.clock()
            if slept > 2 * self.interval:
                # This process itself stood still (SIGSTOP, a C call holding the GIL): its
                # own beat thread saw nothing meanwhile either. The peers get a fresh
                # timeout rather than being blamed for this process's pause.
                self.forgive()
                continue
            verdict = self.check()
            if verdict is not None:
                self.lose(verdict)

    def forgive(self) -> None:
        """Restart every silence count from now."""
        now = self.clock()
        self._last_answer = now
        self._beats = {p: (value, now) for p, (value, _) in self._beats.items()}
        self.progress.restart(now)
        self._errors = {p: now for p in self._errors}

    def note_progress(self, step: int, phase: str = "step") -> None:
        """This process's training loop reached its next event (progress.py): `step` steps
        done, in `phase`. Published with the next beat."""
        self.progress.advance(self.process_id, step, phase, self.clock())

    def beat(self) -> None:
        """One heartbeat: publish this process's count and loop position, read everyone's."""
        self._count += 1
        key = f"{_PREFIX}{_BEAT}/{self.process_id}"
        position, _ = self.progress.positions[self.process_id]
        value = f"{self._count} {position.encode()}"
        answered, _ = self._call(self.client.key_value_set, key, value, allow_overwrite=True)
        if answered:
            started = self.clock()
            answered, entries = self._call(self.client.key_value_dir_get, _PREFIX)
            if answered:
                self.observe(entries, read_started=started)

    def _call(self, method: Any, *args: Any, **kwargs: Any) -> tuple[bool, Any]:
        """(True, `method(...)`), or (False, None) when the service did not answer."""
        try:
            result = method(*args, **kwargs)
        except Exception:  # unreachable, shut down: silence is what `check` looks at
            return False, None
        self._last_answer = self.clock()
        return True, result

    def observe(self, entries: list[tuple[str, str]], read_started: float | None = None) -> None:
        """Take in the key-value store's `jaxtrain/peers/` entries, read by a request sent at
        `read_started` (this process's clock)."""
        now = self.clock()
        for key, value in entries:
            kind, _, index = key.removeprefix(_PREFIX).partition("/")
            peer = int(index) if index.isdigit() else -1
            if peer not in self._beats:  # this process, or not a key of ours
                continue
            if kind == _BEAT and self._beats[peer][0] != value:
                self._beats[peer] = (value, now)
                # The previous read still saw the old value: this one was published after
                # that read was answered, hence after it was sent.
                self._published_after[peer] = self._read_started
                position = Position.decode(value.partition(" ")[2])
                if position is not None:
                    self.progress.see(peer, position, now)
            elif kind == _INFO:
                self._hosts[peer] = value
            elif kind == _LEFT:
                self._left[peer] = value
                if value != "clean":
                    self._errors.setdefault(peer, now)
        self._read_started = read_started

    # ------------------------------------------------------------------ decisions
    def check(self) -> str | None:
        """Why this process must end now (the text of its one line), or None."""
        if self._leaving == "error":  # it is ending with its own message
            return None
        now = self.clock()
        if now - self._last_answer >= self.silence_s:
            return (
                f"lost {self.service}: no answer for {now - self._last_answer:.1f}s "
                "(the host of process 0 is down, or the service was stopped)"
            )
        lost = []
        for peer, (_, seen) in sorted(self._beats.items()):
            if self._left.get(peer) == "clean":
                continue
            if peer in self._errors and now - self._errors[peer] >= self.silence_s:
                lost.append(self._lost(peer, "it ended on an error (see its output)"))
            elif peer not in self._errors and now - seen >= self.silence_s:
                lost.append(self._lost(peer, f"no heartbeat for {now - seen:.1f}s"))
        if lost:
            return "; ".join(lost)
        stuck = self.progress.stuck(now)
        if not stuck:
            return None
        furthest = self.progress.furthest_step()
        return "; ".join(
            f"{self._who(s.process)} is stuck: its training loop has not moved past step "
            f"{s.position.step} for {s.still_s:.1f}s (step_timeout_s={self.step_timeout_s:g}"
            + (
                f"; the furthest process is at step {furthest}"
                if furthest > s.position.step
                else ""
            )
            + ")"
            for s in stuck
        )

    def _who(self, process: int) -> str:
        host = self._hosts.get(process)
        if process == self.process_id:
            host = f"host {socket.gethostname()}, pid {os.getpid()}, this process"
        where = f" ({host})" if host else ""
        return f"process {process} of {self.num_processes}{where}"

    def _lost(self, peer: int, why: str) -> str:
        return f"lost {self._who(peer)}: {why}"

    def lose(self, why: str) -> None:
        """End the process with the one line about the loss `why`."""
        self._end(
            f"jaxtrain: {why}. {self.checkpoint_text()} Exiting with code {EXIT_PEER_LOST}; "
            "start every process again with the same command to resume."
        )

    def checkpoint_text(self) -> str:
        """The newest committed checkpoint on disk now: what a restart resumes from."""
        if self.checkpoints is None:
            return "No checkpoint directory was opened yet."
        steps = self.committed_steps(self.checkpoints)
        if not steps:
            return f"No checkpoint was committed under {self.checkpoints}."
        return f"Last committed checkpoint: step {steps[-1]}, {self.checkpoints / str(steps[-1])}."

    # ------------------------------------------------------------------ ending
    def fail(self, exit_code: int) -> None:
        """This process is ending on an error. A lost peer is often the cause (its death
        or exit breaks a collective here: "Gloo ... Connection closed by peer"), and then
        the line about the peer is the one to print:

        1. wait for a fresh beat of every peer still expected: alive peers beat within an
           interval; a silent one makes the judge thread end the process (its line). Fresh
           means published after this call: a beat sent just before a peer died can be read
           only after its death broke the collective here. A value that a read sent after
           this call did not see yet was published later (`_published_after`), so up to two
           beat intervals are waited for;
        2. take a number from the service's counter of failed processes: the first one
           reports its own error, a later one ends with the line naming the first (whose
           output holds the error). The counter orders the failures across hosts, which
           no clock here could: the same error everywhere is reported once, in full.
        """
        if self._leaving == "error":
            return
        self.exit_code = exit_code
        asked = self.clock()
        deadline = asked + self.timeout_s + 3 * self.interval
        while self.clock() < deadline and self.unconfirmed(asked):
            time.sleep(self.interval / 2)
        _, number = self._call(self.client.key_value_increment, f"{_PREFIX}failures", 1)
        if number == 1:
            self._call(self.client.key_value_set, f"{_PREFIX}first_failure", str(self.process_id))
        elif number is not None:
            answered, first = self._call(
                self.client.blocking_key_value_get,
                f"{_PREFIX}first_failure",
                int(1000 * self.interval * 2),
            )
            if answered and first.isdigit() and int(first) != self.process_id:
                self.leave(error=True)
                self.lose(self._lost(int(first), "it ended on an error first (see its output)"))
        self.leave(error=True)

    def unconfirmed(self, since: float) -> list[int]:
        """The peers still expected that have published no beat after `since` (as far as
        this process can tell: see `fail`)."""
        return [
            p
            for p, after in self._published_after.items()
            if (after is None or after < since) and self._left.get(p) is None
        ]

    def leave(self, *, error: bool) -> None:
        """This process is ending, normally or on an error; said once (an error wins)."""
        if self._leaving is not None and not (error and self._leaving == "clean"):
            return
        self._leaving = "error" if error else "clean"
        self._call(
            self.client.key_value_set,
            f"{_PREFIX}{_LEFT}/{self.process_id}",
            self._leaving,
            allow_overwrite=True,
        )

    def stop(self) -> None:
        """Stop beating and judging (exit hooks; JAX shuts its client down next)."""
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(2 * self.interval)


def end_process(line: str) -> None:
    """Print `line` on stderr and end the process with EXIT_PEER_LOST, now (the module
    docstring says why os._exit)."""
    # stdout is flushed first so that the run's last lines come before this one; a flush
    # that blocks (a reader that stopped reading) must not keep the process alive.
    flusher = threading.Thread(target=_flush_stdout, daemon=True)
    flusher.start()
    flusher.join(0.5)
    os.write(2, (line + "\n").encode())
    os._exit(EXIT_PEER_LOST)


def _flush_stdout() -> None:
    with contextlib.suppress(Exception):  # a closed or broken stdout: nothing to keep
        sys.stdout.flush()


# ---------------------------------------------------------------------- this process's watch
_watch: PeerWatch | None = None


def start_watch(
    client: Any,
    process_id: int,
    num_processes: int,
    timeout_s: float,
    *,
    service: str = "the coordination service",
    step_timeout_s: float | None = None,
    on_clean_exit: Callable[[], None] | None = None,
) -> PeerWatch:
    """Start this process's watch (once) and the hooks that say how it ends: an uncaught
    exception says "error", the exit hooks "clean" (unless an error was said), then
    `on_clean_exit()` runs (process 0 tells its coordination service)."""
    global _watch
    if _watch is not None:
        return _watch
    _watch = PeerWatch(
        client,
        process_id,
        num_processes,
        timeout_s,
        service=service,
        step_timeout_s=step_timeout_s,
    ).start()
    previous = sys.excepthook

    def excepthook(kind: Any, value: Any, traceback: Any) -> None:
        if not isinstance(value, TrainingInterrupted):  # every process stopped together
            report_error()
        previous(kind, value, traceback)

    sys.excepthook = excepthook

    def at_exit() -> None:
        # Registered after jax's own exit hook, so it runs before JAX's shutdown barrier.
        watch = _watch
        if watch is None:
            return
        watch.leave(error=False)  # unless an error was said
        watch.stop()
        if watch._leaving == "clean":
            if on_clean_exit is not None:
                on_clean_exit()
            return
        # Ending on an error: JAX's shutdown barrier would wait for peers that are stuck in
        # a collective or already gone (they end by themselves, told by the error above),
        # and end this process with JAX's C++ abort when the service declares them dead.
        # The error was printed; the hooks skipped are those registered before the cluster
        # formed: JAX's and the standard library's (logging flushes every record anyway).
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(watch.exit_code)

    atexit.register(at_exit)
    return _watch


def note_checkpoints(root: str | Path, committed_steps: Callable[[Path], list[int]]) -> None:
    """The run's checkpoints directory and how to list its committed steps: the line of a
    lost peer names the newest."""
    if _watch is not None:
        _watch.checkpoints, _watch.committed_steps = Path(root), committed_steps


def note_progress(step: int, phase: str = "step") -> None:
    """The training loop reached its next event: `step` steps done, in `phase` ("step",
    "hook" for an evaluation or a save, "end"); what the progress watch (step_timeout_s)
    reads. Nothing happens without a watch."""
    if _watch is not None:
        _watch.note_progress(step, phase)


def report_error(exit_code: int = EXIT_CRASH) -> None:
    """This process is ending on an error and will exit with `exit_code` (see
    PeerWatch.fail); nothing happens without a watch."""
    if _watch is not None:
        _watch.fail(exit_code)
