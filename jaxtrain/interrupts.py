"""Ctrl-C outside the training loop (imports, JAX initialisation, data, model, compile of
the evaluation or sampling, the end-of-run report).

A light module (standard library only) so the command line installs it first thing. The
loop's own handling (`training.stopping.StopSignals`: finish the step, save, exit 130)
replaces it while the loop runs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

_installed = False


def abort(label: str, why: str, number: int = signal.SIGINT) -> None:
    """End the process now with 128 + `number` and one line on stderr; no exit hooks run
    (they can take long, print after this line, or meet another Ctrl-C)."""
    try:
        sys.stdout.flush()
    finally:
        os.write(2, f"{label}: {why}\n".encode())
        os._exit(128 + number)


def installed() -> bool:
    """Whether the command line installed this handling (the loop then ends the process on
    a second signal instead of raising KeyboardInterrupt, which JAX's gc callbacks can drop)."""
    return _installed


def install(label: str = "jaxtrain") -> None:
    """SIGINT ends the process with exit 130 and one line, at once.

    No exception is raised: a KeyboardInterrupt raised at an arbitrary point of start-up
    can land inside an import of a compiled extension (a crash later) or inside a gc
    callback that drops it (the run then trains to the end). Outside the loop nothing is
    half-written that matters: checkpoints commit atomically, and everything else is
    rewritten by the next run.
    """
    global _installed
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(number: int, frame: Any) -> None:
        abort(label, "interrupted by SIGINT outside the training loop; nothing more is saved")

    signal.signal(signal.SIGINT, handle)
    _installed = True


# A stop asked of this process by other means than a signal to the thread that trains: a
# Ray actor's job runs on a worker thread (where no handler can be installed), so the
# actor's main thread, or the launch driver through the actor, records the request here and
# the training loop's StopSignals reads it (finish the step, save, exit 128 + signal).
_stop_requested: str | None = None


def request_stop(signal_name: str) -> bool:
    """Record a stop request ("SIGTERM", "SIGINT"); False when one was recorded already
    (the caller may then end the process at once, as a second Ctrl-C does)."""
    global _stop_requested
    first = _stop_requested is None
    if first:
        _stop_requested = signal_name
    return first


def stop_requested() -> str | None:
    """The signal name of a stop requested through `request_stop`, or None."""
    return _stop_requested
