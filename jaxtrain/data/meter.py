"""DataMeter: how long the training loop waited for data, and what collation cut or padded.

Wraps the ``(batch, stats)`` iterator of a loader; ``fields()`` returns the totals since the
last call as log fields and starts a new window.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["DataMeter"]


class DataMeter:
    def __init__(self) -> None:
        self._wait = 0.0
        self._batches = 0
        self._truncated = 0
        self._padded = 0
        self._window_start = time.perf_counter()

    def wrap(self, batches_with_stats: Iterable[tuple[Any, Any]]) -> Iterator[Any]:
        """Yield the batches of ``(batch, CollateStats | None)`` pairs, timing each wait."""
        it = iter(batches_with_stats)
        while True:
            start = time.perf_counter()
            try:
                batch, stats = next(it)
            except StopIteration:
                return
            self._wait += time.perf_counter() - start
            self._batches += 1
            if stats is not None:
                self._truncated += stats.num_truncated_tokens
                self._padded += stats.num_padding_tokens
            yield batch

    def fields(self) -> dict[str, float]:
        """Log fields of the window since the last call (local to this process)."""
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        out = {
            "data/wait_seconds": self._wait,
            "data/wait_fraction": min(self._wait / elapsed, 1.0),
            "data/truncated_tokens": float(self._truncated),
            "data/padding_tokens": float(self._padded),
        }
        self._wait, self._batches, self._truncated, self._padded = 0.0, 0, 0, 0
        self._window_start = now
        return out
