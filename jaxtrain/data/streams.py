"""Streaming sources: per-process sharding, a windowed shuffle, a checkpointable position.

Host p of P reads its own part of the stream (``IterableSource.iterate``: HF assigns whole
shards per node when it can, other iterables are split row by row). ``stream_window``
shuffles within consecutive blocks of ``window`` rows, each block permuted by a key drawn
from ``(seed, epoch, block)``. A position ``(epoch, offset)`` is therefore resumed by
skipping to the block start and re-permuting that one block: no training data is replayed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from jaxtrain.data.errors import DatasetError
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.sources import IterableSource
from jaxtrain.data.units import Position

__all__ = ["StreamUnits", "stream_window"]


def stream_window(
    rows: Iterable[Any], *, window: int, seed: int, epoch: int, first_block: int = 0
) -> Iterator[tuple[int, Any]]:
    """Yield ``(raw_index, row)`` shuffled within blocks of ``window`` consecutive rows.

    ``rows`` must start at block ``first_block``; raw indices count from the stream start.
    ``window <= 1`` keeps the order.
    """
    it = iter(rows)
    for block in itertools.count(first_block):
        chunk = list(itertools.islice(it, max(window, 1)))
        if not chunk:
            return
        base = block * max(window, 1)
        order = range(len(chunk))
        if window > 1:
            order = np.random.default_rng([seed, epoch, block]).permutation(len(chunk))
        for j in order:
            yield base + int(j), chunk[int(j)]


class StreamUnits:
    """Featurized rows of an iterable source, window-shuffled per epoch, this host's share."""

    def __init__(
        self,
        source: IterableSource,
        featurizer: Featurizer,
        *,
        seed: int,
        shuffle: bool,
        window: int,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        if window < 1:
            raise ValueError(f"stream_window must be >= 1, got {window}")
        self.source, self.featurizer = source, featurizer
        self.seed, self.window, self.shuffle = seed, window if shuffle else 1, shuffle
        self.process_index, self.process_count = process_index, process_count

    def iterate(self, start: Position = (0, 0)) -> Iterator[tuple[Position, dict[str, Any]]]:
        epoch, offset = start
        while True:
            block = offset // self.window
            rows = self.source.iterate(
                self.process_index, self.process_count, skip=block * self.window
            )
            shuffled = stream_window(
                rows, window=self.window, seed=self.seed, epoch=epoch, first_block=block
            )
            seen = block * self.window
            skip = offset - seen
            for pos, (raw, row) in enumerate(shuffled, seen):
                if pos < offset:
                    continue
                (example,) = self.featurizer([row], [raw])
                yield (epoch, pos), example
                seen = pos + 1
            if seen == 0 and not skip:
                raise DatasetError(
                    f"{self.source.name} yielded no rows for process {self.process_index} of "
                    f"{self.process_count} (epoch {epoch}); it is empty or has fewer rows than "
                    "processes. Add data"
                )
            epoch, offset = epoch + 1, 0
