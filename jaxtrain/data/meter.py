"""DataMeter: how many tokens collation truncated or padded, reported at logging cadence.

Wraps the ``(batch, stats)`` iterator of a loader; ``fields()`` returns the totals since the
last call as log fields, ``truncation_summary()`` the run's share of tokens truncation dropped
and ``empty_rows_summary()`` its rows with no token to learn from (for the end-of-run summary;
the first such row is warned about when it is read). The time the loop waits for data is measured by the RunMonitor
(``data_wait_s``), around the whole prefetched iterator.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX

__all__ = ["DataMeter"]

logger = logging.getLogger("jaxtrain.data")

# Why a row of a language-model batch has no target: what the warning and summary say.
EMPTY_ROW_CAUSES = (
    "empty text, a one-token row, or completion_only_loss with the completion truncated "
    "away; they train as padding. Drop such rows, or raise max_sequence_length"
)


class DataMeter:
    def __init__(self) -> None:
        self._truncated = 0
        self._padded = 0
        # Whole run (this process): tokens read = kept in batches + truncated.
        self._run_truncated = 0
        self._run_kept = 0
        self._run_rows = 0
        self._run_empty_rows = 0  # rows without a target token

    def wrap(self, batches_with_stats: Iterable[tuple[Any, Any]]) -> Iterator[Any]:
        """Yield the batches of ``(batch, CollateStats | None)`` pairs, counting the stats."""
        for batch, stats in batches_with_stats:
            if stats is not None:
                self._truncated += stats.num_truncated_tokens
                self._padded += stats.num_padding_tokens
                self._run_truncated += stats.num_truncated_tokens
                self._run_kept += _slots(batch) - stats.num_padding_tokens
                self._count_rows(batch)
            yield batch

    def _count_rows(self, batch: Any) -> None:
        """Counts the rows of a language-model batch that have no target token."""
        rows, empty = _rows_without_targets(batch)
        if empty and not self._run_empty_rows and jax.process_index() == 0:
            logger.warning(
                "jaxtrain: %d of %d rows of a training batch have no token to learn from (%s).",
                empty,
                rows,
                EMPTY_ROW_CAUSES,
            )
        self._run_rows += rows
        self._run_empty_rows += empty

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
            f"({self._run_truncated} of {read}); raise max_sequence_length (or, for documents, "
            "packing=True splits them instead)"
        )

    def empty_rows_summary(self) -> str | None:
        """ "N of M rows had no token to learn from ..." for the run so far, or None."""
        if not self._run_empty_rows:
            return None
        return (
            f"{self._run_empty_rows} of the {self._run_rows} rows trained on had no token to "
            f"learn from ({EMPTY_ROW_CAUSES})"
        )


def _host(batch: Any) -> Any:
    return batch[0] if isinstance(batch, tuple) else batch


def _rows_without_targets(batch: Any) -> tuple[int, int]:
    """(rows, rows whose labels predict nothing) of a token batch; (0, 0) for any other (a
    classifier's one label per row, a pair task's sides)."""
    host = _host(batch)
    if not isinstance(host, dict) or "labels" not in host or "input_ids" not in host:
        return 0, 0
    labels = np.asarray(host["labels"])
    if labels.shape != np.shape(host["input_ids"]) or labels.ndim < 2:
        return 0, 0
    rows = labels.reshape(-1, labels.shape[-1])
    # The loss predicts position t+1 from t: a row's targets are its labels after the first.
    empty = int((~(rows[:, 1:] != IGNORE_INDEX).any(axis=1)).sum())
    return len(rows), empty


def _slots(batch: Any) -> int:
    """Token positions of a host batch (or of a (host batch, placed batch) pair): of all its
    ``*input_ids`` arrays (a pair task's ``rejected_input_ids`` too, as its padding counts)."""
    host = _host(batch)
    if not isinstance(host, dict):
        return 0
    return sum(int(getattr(v, "size", 0)) for k, v in host.items() if k.endswith("input_ids"))
