"""Why a run stops before its last step: signals, a time limit, a diverging loss.

Each reason is a small object the loop polls once per step. None of them stops mid-step:
the loop finishes the step it is in, saves, and only then leaves, so no work is lost.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxtrain import interrupts
from jaxtrain.config.tables import parse_duration
from jaxtrain.errors import (  # noqa: F401  (re-exported: their old home)
    EXIT_BAD_INPUT,
    EXIT_CRASH,
    EXIT_NONFINITE,
    EXIT_OK,
    EXIT_TIME_LIMIT,
    ArgumentError,
    NonFiniteLossError,
    TrainingInterrupted,
)

# ------------------------------------------------------------------ time limit


def time_limit_seconds(limit: str | None) -> float | None:
    """Seconds of a `training_time_limit` (None: no limit)."""
    return None if limit is None else parse_duration(limit)


class Deadline:
    """Wall-clock budget of a run, counted from its start (not from the first compile)."""

    def __init__(self, limit_seconds: float | None):
        self.limit_seconds = limit_seconds
        self._start = time.monotonic()

    def expired(self) -> bool:
        return (
            self.limit_seconds is not None and time.monotonic() - self._start >= self.limit_seconds
        )


# --------------------------------------------------------------------- signals
class StopSignals:
    """Turns the first SIGINT/SIGTERM into a request to stop after the current step.

    A second signal raises KeyboardInterrupt at once: the user asked twice. Handlers are
    installed only in the main thread (Python allows nothing else) and restored on exit.
    """

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self._received: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def received(self) -> str | None:
        """The first signal's name: one this thread's handler took, or a stop requested of
        the process (interrupts.request_stop: a Ray actor's, whose job runs off the main
        thread)."""
        return self._received or interrupts.stop_requested()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _handle(self, number: int, frame: Any) -> None:
        if self._received is not None:
            name = signal.Signals(number).name
            if interrupts.installed():  # the command line: end now, no traceback
                interrupts.abort("jaxtrain", f"second {name}: aborting at once", number)
            raise KeyboardInterrupt(f"second {name}: aborting at once")
        self._received = signal.Signals(number).name


def preemption_sync_reached(step: int) -> bool:
    """With several processes: whether every process has reached the step JAX's preemption
    sync chose after a SIGTERM. `jax.distributed.initialize` installs JAX's own SIGTERM
    notifier; a loop on the main thread replaces it with StopSignals' handler, but a Ray
    actor's job runs off the main thread and installs none, so there the notifier gets the
    signal, and every process stops at the step this returns True for. Called every step."""
    if jax.process_count() == 1 or not jax.config.jax_enable_preemption_service:
        return False  # (turned off, JAX takes no SIGTERM: StopSignals' handler does)
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))


# ----------------------------------------------------------- non-finite loss
class NonFiniteGuard:
    """Watches the step's `nonfinite` flag, read one step late so dispatch stays async.

    The jitted step never applies a non-finite update (see step.py), so the train state stays
    good either way; this decides whether the run goes on ("skip") or stops ("stop").
    """

    def __init__(self, mode: str, max_consecutive_skips: int):
        self.mode, self.max_consecutive_skips = mode, max_consecutive_skips
        self._consecutive = 0
        self._pending: tuple[int, Any] | None = None

    def push(self, step: int, flag: jax.Array) -> None:
        """Record step's flag (still on device) and check the previous step's."""
        previous, self._pending = self._pending, (step, flag)
        if previous is not None:
            self._check(*previous)

    def flush(self) -> None:
        """Check the newest flag now (before a save or an evaluation reads the state)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._check(*pending)

    def _check(self, step: int, flag: Any) -> None:
        if not bool(np.asarray(jax.device_get(flag))):
            self._consecutive = 0
            return
        if self.mode == "stop":
            raise NonFiniteLossError(
                f"The loss or gradients became NaN/Inf at step {step}; that update was not "
                "applied and nothing after it was saved. Lower learning_rate, set clip_grad, "
                "check the data of that step, or pass --on_nan skip to skip such updates."
            )
        self._consecutive += 1
        if self._consecutive > self.max_consecutive_skips:
            raise NonFiniteLossError(
                f"{self._consecutive} consecutive steps up to step {step} had a NaN/Inf loss "
                f"(max_nan_skips={self.max_consecutive_skips}); the run is diverging. Lower "
                "learning_rate or fix the data, then resume from the last checkpoint."
            )


def any_process(flags: list[bool]) -> list[bool]:
    """Element-wise OR of `flags` over all processes: every host must stop or save at the
    same step, or the ones still stepping would wait forever in the next collective."""
    if jax.process_count() == 1:
        return list(flags)
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(flags, np.int32))
    return [bool(v) for v in np.asarray(gathered).reshape(-1, len(flags)).any(axis=0)]
