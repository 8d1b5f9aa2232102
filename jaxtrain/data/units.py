"""Documents in a deterministic, resumable order: the input of packing and streaming.

A unit stream yields ``(position, example)`` forever (epochs roll over), where ``position``
= ``(epoch, offset)`` is where the stream stands *before* that example: starting a new
stream at that position yields that example first. Positions are tiny and JSON-able, so a
checkpoint stores one and a resume reads nothing twice.

``MapUnits`` orders a random-access source: epoch e is the permutation drawn from
``(seed, e)``, and host p of P takes every P-th entry of it (reading only those rows).
``streams.StreamUnits`` does the same for iterable sources.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxtrain.data.errors import DatasetError
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.sources import RandomAccessSource

__all__ = ["MapUnits", "Position"]

Position = tuple[int, int]  # (epoch, offset within this host's share of the epoch)
READ_CHUNK = 64


def epoch_order(num_rows: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Row order of one epoch: a pure function of (seed, epoch)."""
    if shuffle:
        return np.random.default_rng([seed, epoch]).permutation(num_rows)
    return np.arange(num_rows)


class MapUnits:
    """Featurized rows of a random-access source, shuffled per epoch, this host's share."""

    def __init__(
        self,
        source: RandomAccessSource,
        featurizer: Featurizer,
        *,
        seed: int,
        shuffle: bool,
        process_index: int = 0,
        process_count: int = 1,
    ) -> None:
        if len(source) < process_count:
            raise DatasetError(
                f"{source.name} has {len(source)} rows, fewer than the {process_count} "
                "processes that share it; add data"
            )
        self.source, self.featurizer = source, featurizer
        self.seed, self.shuffle = seed, shuffle
        self.process_index, self.process_count = process_index, process_count
        self._order: tuple[int, np.ndarray] | None = None

    def host_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            order = epoch_order(len(self.source), seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            self._order = (epoch, order[self.process_index :: self.process_count])
        return self._order[1]

    def iterate(self, start: Position = (0, 0)) -> Iterator[tuple[Position, dict[str, Any]]]:
        epoch, offset = start
        while True:
            order = self.host_order(epoch)
            for lo in range(offset, len(order), READ_CHUNK):
                idx = [int(i) for i in order[lo : lo + READ_CHUNK]]
                examples = self.featurizer(self.source.read(idx), idx)
                for j, example in enumerate(examples):
                    yield (epoch, lo + j), example
            epoch, offset = epoch + 1, 0
