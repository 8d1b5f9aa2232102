"""DataMeter: how many tokens collation truncated or padded, reported at logging cadence.

Wraps the ``(batch, stats)`` iterator of a loader; ``fields()`` returns the totals since the
last call as log fields, ``truncation_summary()`` the run's share of tokens truncation dropped
(for the end-of-run summary). The time the loop waits for data is measured by the RunMonitor
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
        # Whole run (this process): tokens read = kept in batches + truncated.
        self._run_truncated = 0
        self._run_kept = 0

    def wrap(self, batches_with_stats: Iterable[tuple[Any, Any]]) -> Iterator[Any]:
        """Yield the batches of ``(batch, CollateStats | None)`` pairs, counting the stats."""
        for batch, stats in batches_with_stats:
            if stats is not None:
                self._truncated += stats.num_truncated_tokens
                self._padded += stats.num_padding_tokens
                self._run_truncated += stats.num_truncated_tokens
                self._run_kept += _slots(batch) - stats.num_padding_tokens
            yield batch

    def fields(self) -> dict[str, float]:
        """Log fields of the window since the last call (local to this process)."""
        out = {
            "data/truncated_tokens": float(self._truncated),
            "data/padding_tokens": float(self._padded),
        }
        self._truncated, self._padded = 0, 0
        return out

    def truncation_summary(self) -> str | None:
        """ "dropped X% of ..." for the run so far, or None when truncation dropped nothing."""
        if not self._run_truncated:
            return None
        read = self._run_kept + self._run_truncated
        return (
            f"truncation dropped {100 * self._run_truncated / read:.1f}% of the tokens read "
            f"({self._run_truncated} of {read}); raise max_sequence_length, or use packing=True "
            "to split long documents instead"
        )


def _slots(batch: Any) -> int:
    """Token positions of a host batch (or of a (host batch, placed batch) pair)."""
    host = batch[0] if isinstance(batch, tuple) else batch
    ids = host.get("input_ids") if isinstance(host, dict) else None
    return int(getattr(ids, "size", 0))
