"""Padding-free batches of multi-sequence units: preference pairs, KTO examples.

A unit is what one loss term reads: a pair's chosen and rejected sequences, a KTO example's
completion and its mismatched KL sequence. Padded, each sequence fills a row of
``max_sequence_length`` (L) tokens; packed, the sequences of many units share rows, each
isolated by its segment id and numbered from position 0 (the LM path's mechanism,
data/packing.py), so each sequence's log-probs are the ones it has alone in a row.

A micro-batch of this process is ``rows`` rows of L tokens holding at most ``capacity``
units. Units are taken in the stream's order; each sequence goes to the row with the least
room that still fits it (best fit); the first unit whose sequences do not fit closes the
micro-batch and opens the next. Every sequence of a unit is in the same micro-batch (a pair
longer than a row has its chosen and rejected in two rows). Arrays of a micro-batch:

- ``input_ids``, ``labels``, ``attention_mask``, ``segment_ids``, ``positions`` [rows, L]
  (labels -100 on prompts, padding and each sequence's first token);
- ``sequence_index`` [rows, L]: the sequence each token belongs to, ``k * N + u`` for side k
  of unit u of the global micro-batch (N = capacity x processes; this process's units are
  ``process_index * capacity + j``), 0 on padding;
- ``pair_mask`` [capacity] (1 for a real unit), and each per-unit float column [capacity].

The trainers' objectives read both layouts (trainers/sequences.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX, CollateStats, tokens_cut
from jaxtrain.data.errors import DatasetError

__all__ = ["MIN_UNIT_TOKENS", "PackedUnits", "RowSpace", "UnitLayout", "pack_units"]

# A unit holds at least two sequences of at least two tokens: the capacity of a micro-batch
# (units per row) is set so that it never binds before its rows are full.
MIN_UNIT_TOKENS = 4


class UnitLayout(Protocol):
    """How a task's examples become sequences (see PairLayout / KTOLayout)."""

    sides: int  # sequences per unit
    float_columns: tuple[str, ...]  # per-unit float columns copied into the batch

    def sequences(self, example: dict[str, Any], previous: dict[str, Any] | None):
        """[(side, ids, labels)] of `example` placed when it joins a micro-batch after
        `previous` (None for the micro-batch's first unit)."""

    def closing(self, first: dict[str, Any], last: dict[str, Any]):
        """[(side, ids, labels)] of the micro-batch's first unit placed when it closes with
        `last` as its last unit (KTO's rotated KL sequence), or []."""


class RowSpace:
    """Free room of `rows` rows of `seq_len` tokens, filled by best fit."""

    def __init__(self, rows: int, seq_len: int):
        self.free = [seq_len] * rows

    def fit(self, lengths: list[int]) -> list[int] | None:
        """Rows for `lengths` placed in order (each to the fullest row that fits), or None
        (and nothing placed) when one does not fit."""
        free, placed = list(self.free), []
        for n in lengths:
            fits = [r for r, room in enumerate(free) if room >= n]
            if not fits:
                return None
            row = min(fits, key=lambda r: (free[r], r))
            free[row] -= n
            placed.append(row)
        self.free = free
        return placed


class PackedUnits:
    """One micro-batch being filled: its units and where each sequence sits."""

    def __init__(self, layout: UnitLayout, rows: int, seq_len: int, capacity: int):
        self.layout, self.rows, self.seq_len, self.capacity = layout, rows, seq_len, capacity
        self.space = RowSpace(rows, seq_len)
        self.units: list[dict[str, Any]] = []
        # (row, side, unit, ids, labels) of every sequence placed so far
        self.placed: list[tuple[int, int, int, np.ndarray, np.ndarray]] = []

    def add(self, example: dict[str, Any]) -> bool:
        """Place `example` (and re-check the closing sequences); False when it does not fit."""
        if len(self.units) >= self.capacity:
            return False
        previous = self.units[-1] if self.units else None
        first = self.units[0] if self.units else example
        new = self.layout.sequences(example, previous)
        closing = self.layout.closing(first, example)
        lengths = [len(ids) for _, ids, _ in new + closing]
        rows = self.space.fit(lengths)
        if rows is None:
            return False
        # The closing sequences only had to fit: they are placed when the micro-batch closes
        # (with the last unit added), so their room is given back until then.
        for (_, ids, _), row in zip(closing, rows[len(new) :]):
            self.space.free[row] += len(ids)
        unit = len(self.units)
        for (side, ids, labels), row in zip(new, rows):
            self.placed.append((row, side, unit, ids, labels))
        self.units.append(example)
        return True

    def close(self) -> list[tuple[int, int, int, np.ndarray, np.ndarray]]:
        """Every sequence with its row, side and unit (the closing ones placed now: the
        last `add` checked they fit)."""
        placed = list(self.placed)
        if self.units:
            closing = self.layout.closing(self.units[0], self.units[-1])
            rows = self.space.fit([len(ids) for _, ids, _ in closing])
            if rows is None:  # add() reserved their room: this cannot happen
                raise RuntimeError("the closing sequences of a packed micro-batch do not fit")
            placed += [
                (row, side, 0, ids, labels) for (side, ids, labels), row in zip(closing, rows)
            ]
        return placed


def _arrays(
    packed: PackedUnits, *, pad_token_id: int, unit_offset: int, units_total: int
) -> tuple[dict[str, np.ndarray], CollateStats]:
    rows, t, capacity = packed.rows, packed.seq_len, packed.capacity
    out = {
        "input_ids": np.full((rows, t), pad_token_id, np.int32),
        "attention_mask": np.zeros((rows, t), np.int32),
        "labels": np.full((rows, t), IGNORE_INDEX, np.int32),
        "segment_ids": np.zeros((rows, t), np.int32),
        "positions": np.zeros((rows, t), np.int32),
        "sequence_index": np.zeros((rows, t), np.int32),
    }
    fill = [0] * rows
    segments = [0] * rows
    for row, side, unit, ids, labels in sorted(packed.close(), key=lambda p: (p[0], p[1], p[2])):
        n, at = len(ids), fill[row]
        segments[row] += 1
        window = slice(at, at + n)
        out["input_ids"][row, window] = ids
        out["attention_mask"][row, window] = 1
        out["labels"][row, window] = labels
        out["labels"][row, at] = IGNORE_INDEX  # never predicted from the previous sequence
        out["segment_ids"][row, window] = segments[row]
        out["positions"][row, window] = np.arange(n)
        out["sequence_index"][row, window] = side * units_total + unit_offset + unit
        fill[row] += n
    real = len(packed.units)
    out["pair_mask"] = (np.arange(capacity) < real).astype(np.float32)
    for column in packed.layout.float_columns:
        values = np.zeros(capacity, np.float32)
        values[:real] = [u[column] for u in packed.units]
        out[column] = values
    return out, CollateStats(tokens_cut(packed.units), rows * t - sum(fill))


def pack_units(
    examples: Iterator[dict[str, Any]] | Any,
    layout: UnitLayout,
    *,
    rows: int,
    seq_len: int,
    capacity: int,
    pad_token_id: int,
    process_index: int = 0,
    process_count: int = 1,
) -> tuple[dict[str, np.ndarray], CollateStats]:
    """One packed micro-batch from `examples`, a peekable stream (``peek()`` -> the next
    example without taking it, ``take()``): units are taken while they fit."""
    packed = PackedUnits(layout, rows, seq_len, capacity)
    while packed.add(examples.peek()):
        examples.take()
    if not packed.units:
        raise DatasetError(
            f"a unit of {layout.sides} sequences does not fit {rows} empty rows of {seq_len} "
            "tokens; give each process at least that many rows per micro-batch"
        )
    return _arrays(
        packed,
        pad_token_id=pad_token_id,
        unit_offset=process_index * capacity,
        units_total=capacity * process_count,
    )
