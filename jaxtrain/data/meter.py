"""DataMeter: how many tokens collation truncated or padded, reported at logging cadence.

Wraps the ``(batch, stats)`` iterator of a loader; ``fields()`` returns the totals since the
last call as log fields. The time the loop waits for data is measured by the RunMonitor
(``data_wait_s``), around the whole prefetched iterator.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["DataMeter"]


class DataMeter:
    def __init__(self) -> None:
        self._truncated = 0
        self._padded = 0

    def wrap(self, batches_with_stats: Iterable[tuple[Any, Any]]) -> Iterator[Any]:
        """Yield the batches of ``(batch, CollateStats | None)`` pairs, counting the stats."""
        for batch, stats in batches_with_stats:
            if stats is not None:
                self._truncated += stats.num_truncated_tokens
                self._padded += stats.num_padding_tokens
            yield batch

    def fields(self) -> dict[str, float]:
        """Log fields of the window since the last call (local to this process)."""
        out = {
            "data/truncated_tokens": float(self._truncated),
            "data/padding_tokens": float(self._padded),
        }
        self._truncated, self._padded = 0, 0
        return out
