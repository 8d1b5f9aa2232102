"""One source of a mixture read row by row: its own loader, one row per process per position.

Each source keeps the loader it would have alone (jaxtrain.data.pipeline: tokenizing,
chat rendering, packing, streaming, per-process shares), built with a global batch of one
row per process. A "position" of that loader is then one row on every process, so the
mixture can take any number of rows from it in a step, and the loader's own position and
resume (data_state / check_data_state) are the source's.

`MapRows` reads a random-access source (a BatchLoader) and collates its rows a chunk at a
time; `UnitRows` steps a packing or streaming loader (a UnitLoader) once per row. Both hand
out the rows of several steps at once (`take_steps`), with what each step needs to know of
them: its collate stats, its target tokens, the position after it and whether it read past
the source's first epoch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxtrain.data.collate import CollateStats
from jaxtrain.data.loader import BatchLoader
from jaxtrain.data.unit_loader import UnitLoader
from jaxtrain.data.units import MapUnits

__all__ = ["MapRows", "RowReader", "Taken", "UnitRows", "row_reader"]

Rows = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Taken:
    """The rows a source gives to several steps (`rows`: [all of them, ...], step by step)
    and, per step, their collate stats (None: none taken, or a user collator's), the
    source's position after the step and whether it has then read past its first epoch."""

    rows: Rows
    stats: list[CollateStats | None]
    positions: list[int]
    past_first_epoch: list[bool]


class _Read:
    """Rows [first, first + size) of a source read at once."""

    def __init__(self, first: int, rows: Rows, stats: CollateStats | None):
        self.first, self.rows, self.stats = first, rows, stats
        self.size = len(rows["input_ids"])
        self.end = first + self.size


class MapRows:
    """Rows of a BatchLoader; position p holds row p of the source's endless shuffled order
    (on each process, its own row of that position). Rows are read `chunk` at a time: a
    read, a featurizing and a collation cost about as much for 4 rows as for 64, and a
    source of a mixture gives only a few rows to each step."""

    def __init__(self, loader: BatchLoader, chunk: int = 64):
        self.loader, self.chunk = loader, chunk
        self.state_is_per_process = False
        self.position = 0
        self._read: _Read | None = None

    def open(self, position: int) -> None:
        self.position, self._read = position, None

    def take_steps(self, counts: Sequence[int]) -> Taken:
        """The next rows: `counts[i]` of them for step i."""
        pieces: list[tuple[_Read, int, int]] = []  # slices of reads, in order
        stats, positions, past = [], [], []
        epoch_rows = self.loader.steps_per_epoch
        for n in counts:
            if n:
                start, end = self.position, self.position + n
                read = self._read
                if read is None or end > read.end:
                    rows, read_stats = self.loader.rows_at(range(start, start + max(n, self.chunk)))
                    read = self._read = _Read(start, rows, read_stats)
                a, b = start - read.first, end - read.first
                self.position = end
                if pieces and pieces[-1][0] is read:  # the last slice goes on
                    pieces[-1] = (read, pieces[-1][1], b)
                else:
                    pieces.append((read, a, b))
                stats.append(_share(read.stats, read.size, a, b))
            else:
                stats.append(None)
            positions.append(self.position)
            past.append(n > 0 and self.position > epoch_rows)
        parts = [{k: v[a:b] for k, v in read.rows.items()} for read, a, b in pieces]
        return Taken(_join(parts), stats, positions, past)

    def epoch(self, position: int) -> float:
        """Epochs of the source used by `position` rows."""
        return position / self.loader.steps_per_epoch

    def data_state(self, position: int) -> dict[str, Any]:
        return self.loader.data_state(position)

    def check_data_state(self, state: dict[str, Any]) -> int:
        return self.loader.check_data_state(state)


class UnitRows:
    """Rows of a UnitLoader (packing or streaming), one loader step per row."""

    def __init__(self, loader: UnitLoader):
        self.loader = loader
        self.state_is_per_process = True
        self.position = 0
        self._batches: Iterator[Any] | None = None
        self._past_first_epoch = False

    def open(self, position: int) -> None:
        self.position = position
        self._batches = self.loader.batches(start_step=position, with_stats=True)
        self._past_first_epoch = False

    def take_steps(self, counts: Sequence[int]) -> Taken:
        """The next rows: `counts[i]` of them for step i."""
        if self._batches is None:
            self.open(self.position)
        batches, stats, positions, past = [], [], [], []
        for n in counts:
            counted, truncated, padding = False, 0, 0  # plain ints: no stats object per row
            for _ in range(n):
                batch, row_stats = next(self._batches)
                batches.append(batch)
                if row_stats is not None:
                    counted = True
                    truncated += row_stats.num_truncated_tokens
                    padding += row_stats.num_padding_tokens
                self._past_first_epoch |= self.loader.last_epoch > 0
            self.position += n
            stats.append(CollateStats(truncated, padding) if counted else None)
            positions.append(self.position)
            past.append(n > 0 and self._past_first_epoch)
        # [steps, rows of a step, ...] batches of the loader, one concatenation per field.
        rows = {
            k: np.concatenate([b[k] for b in batches]).reshape(-1, *v.shape[2:])
            for k, v in batches[0].items()
        }
        return Taken(rows, stats, positions, past)

    def epoch(self, position: int) -> float:
        """Epochs of the source this process used by `position` rows (fractional when the
        source's length is known: random-access rows; a stream counts whole epochs)."""
        state = self.loader.data_state(position)
        units = self.loader.units
        if isinstance(units, MapUnits):  # this process's rows of an epoch: every P-th
            p, processes = units.process_index, units.process_count
            share = -(-(len(units.source) - p) // processes)
            return state["epoch"] + state["offset"] / share
        return float(state["epoch"])

    def data_state(self, position: int) -> dict[str, Any]:
        return self.loader.data_state(position)

    def check_data_state(self, state: dict[str, Any]) -> int:
        return self.loader.check_data_state(state)


def _join(parts: list[Rows]) -> Rows:
    """Rows of several parts, one after the other."""
    if len(parts) == 1:
        return parts[0]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _share(stats: CollateStats | None, rows: int, start: int, end: int) -> CollateStats | None:
    """The part of a read's collate stats that rows [start, end) of its `rows` carry: whole
    tokens, adding up to the read's counts once every row is taken."""
    if stats is None:
        return None
    truncated, padding = stats.num_truncated_tokens, stats.num_padding_tokens
    return CollateStats(
        truncated * end // rows - truncated * start // rows,
        padding * end // rows - padding * start // rows,
    )


RowReader = MapRows | UnitRows


def row_reader(loader: BatchLoader | UnitLoader, *, history: int) -> RowReader:
    """The reader of a source's loader; `history`: positions a UnitLoader keeps (the rows of
    every step the read-ahead can be ahead by)."""
    if isinstance(loader, BatchLoader):
        return MapRows(loader)
    loader.history = max(loader.history, history)
    return UnitRows(loader)
