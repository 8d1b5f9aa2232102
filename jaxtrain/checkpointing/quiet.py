"""Orbax's own reports that would reach the user after jaxtrain's one-line error.

Every Orbax failure reaches the user once, as the CheckpointError that names the step
directory and the way forward; Orbax's background-thread tracebacks would repeat it, and
Tensorstore's "Event loop is closed" reports (a read's or write's future completing after
Orbax closed its asyncio loop, harmless) would print around it.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any


class _OrbaxErrors(logging.Filter):
    """Drops Orbax's own ERROR logs (tracebacks from its background threads): every failed
    write reaches the user once, as the CheckpointError `_Saver` raises for it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR or "orbax" not in record.pathname


class _OrbaxTasks(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for Orbax's own tasks: when one
    read of a restore fails, Orbax raises it and leaves the sibling reads' failures (the
    same damage) unretrieved; asyncio would log each one when it is collected."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("never retrieved" in message and "orbax" in message)


def quiet_orbax() -> None:
    """Installed once per process, before Orbax first runs (idempotent)."""
    for name, kind in (("absl", _OrbaxErrors), ("asyncio", _OrbaxTasks)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
    if not getattr(sys.unraisablehook, "jaxtrain_closed_loop", False):
        sys.unraisablehook = _without_closed_loop_reports(sys.unraisablehook)


def _without_closed_loop_reports(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """Tensorstore completes a read's or write's future after Orbax gave up and closed the
    asyncio loop that waited for it (a refused restore, a failed save). The callback's
    RuntimeError("Event loop is closed") reaches `sys.unraisablehook` from Tensorstore's
    own thread and would print a bare traceback around jaxtrain's one-line error. Nothing
    is lost (Orbax has already failed and jaxtrain reports that), so exactly that report is
    dropped; every other unraisable exception still reaches the previous hook."""

    def hook(report: Any) -> None:
        frames = traceback.extract_tb(report.exc_traceback)
        if (
            report.exc_type is RuntimeError
            and str(report.exc_value) == "Event loop is closed"
            and any(frame.name == "call_soon_threadsafe" for frame in frames)
        ):
            return
        previous(report)

    hook.jaxtrain_closed_loop = True  # type: ignore[attr-defined]
    return hook
