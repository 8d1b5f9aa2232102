"""Orbax's own reports that would reach the user after jaxtrain's one-line error.

Every Orbax failure reaches the user once, as the CheckpointError that names the step
directory and the way forward; Orbax's background-thread tracebacks would repeat it, and
Tensorstore's "Event loop is closed" reports (a write's future completing after Orbax
closed its asyncio loop, harmless) would print after it.
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


def quiet_orbax() -> None:
    """Installed once per process, before Orbax first runs (idempotent)."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _OrbaxErrors) for f in logger.filters):
        logger.addFilter(_OrbaxErrors())
    if not getattr(sys.excepthook, "jaxtrain_closed_loop", False):
        sys.excepthook = _without_closed_loop_reports(sys.excepthook)


def _without_closed_loop_reports(previous: Callable[..., None]) -> Callable[..., None]:
    """Tensorstore completes a write's future after Orbax closed the asyncio loop that
    waited for it; the callback's RuntimeError("Event loop is closed") is printed through
    sys.excepthook as a bare traceback (often after jaxtrain's own error). Nothing is lost
    (the write had finished), so exactly that report is dropped."""

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        frames = traceback.extract_tb(tb)
        if (
            kind is RuntimeError
            and str(value) == "Event loop is closed"
            and frames
            and frames[0].name == "call_soon_threadsafe"
        ):
            return
        previous(kind, value, tb)

    hook.jaxtrain_closed_loop = True  # type: ignore[attr-defined]
    return hook
