"""UnitLoader: train batches from a unit stream (packing and/or streaming), resumable.

Documents come from a unit stream (``units.MapUnits``/``streams.StreamUnits``) in a fixed
order; the position ``(epoch, offset, row)`` after each step is recorded, checkpointed, and
resumed from (``row``: rows of the packing block at ``offset`` already used; 0 without
packing). Its interface is BatchLoader's (loader.py); host p reads only its own part of the
stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxtrain.data.assemble import Collation
from jaxtrain.data.collate import CollateStats
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.loader import check_batch, check_processes, check_same_data
from jaxtrain.data.packing import ImageSlots, Packer
from jaxtrain.data.streams import StreamUnits
from jaxtrain.data.units import MapUnits, Position

__all__ = ["UnitLoader", "UnitPacker"]

_HISTORY = 256  # steps whose data position UnitLoader remembers (prefetch runs ahead)


class _Peek:
    """A unit stream with a look-ahead: ``position()`` is where the next example sits."""

    def __init__(self, units: Iterator[tuple[Position, dict[str, Any]]]) -> None:
        self._units, self._next = units, None
        self.last: Position | None = None  # the position of the example taken last

    def position(self) -> Position:
        if self._next is None:
            self._next = next(self._units)
        return self._next[0]

    def take(self) -> tuple[Position, dict[str, Any]]:
        self.position()
        item, self._next = self._next, None
        self.last = item[0]
        return item

    def peek(self) -> dict[str, Any]:
        """The next example, left in the stream."""
        self.position()
        return self._next[1]


# A micro-batch of multi-sequence units packed from a peekable example stream (peek(),
# take()): (arrays, collate stats). data/unit_packing.py's pack_units, bound to a layout.
UnitPacker = Callable[[Any], tuple[dict[str, np.ndarray], CollateStats]]


class UnitLoader:
    """Endless, resumable batches from a unit stream: packed rows, one document per row, or
    (``unit_packer``) micro-batches of multi-sequence units packed into rows (preference
    pairs: data/unit_packing.py).

    The position after every step is remembered (the last 256 steps, enough for prefetch),
    so ``data_state(step)`` can be read after the loop has moved on. ``steps_per_epoch`` is
    None: an epoch's length depends on the documents, so runs set ``max_steps``. A batch may
    straddle two epochs; nothing is dropped.
    """

    # Each process has its own position in its share of the data (a checkpoint gathers them).
    state_is_per_process = True

    def __init__(
        self,
        units: MapUnits | StreamUnits,
        collation: Collation,
        *,
        global_batch_size: int,
        accumulation_steps: int,
        packing: bool,
        packing_window: int = 1024,
        split_long_documents: bool = True,
        unit_packer: UnitPacker | None = None,
        history: int = _HISTORY,
        image_slots: ImageSlots | None = None,
    ) -> None:
        micro = check_batch(global_batch_size, accumulation_steps)
        check_processes(units.process_index, units.process_count, micro, "micro-batch size")
        if packing and collation.collator is not None:
            raise ValueError(
                "packing=True builds its own rows; it cannot be combined with a data_collator. "
                "Drop one of them."
            )
        if packing and packing_window < 1:
            raise ValueError(f"packing_window must be >= 1, got {packing_window}")
        self.units, self.collation, self.packing = units, collation, packing
        self.image_slots = image_slots  # rows with images: the Packer fills their slots
        self.unit_packer = unit_packer
        self.packing_window, self.split_long_documents = packing_window, split_long_documents
        self.global_batch_size, self.accumulation_steps = global_batch_size, accumulation_steps
        self.micro_batch_size, self.seq_len = micro, collation.seq_len
        self.rows_per_step = global_batch_size // units.process_count
        self.name = units.source.name
        self._positions: dict[int, tuple[int, int, int]] = {0: (0, 0, 0)}
        # Steps whose position is kept: enough for the read-ahead (a mixture reads a source
        # row by row, so it keeps more).
        self.history = history
        self.last_epoch = 0  # the epoch of the newest batch's last row

    steps_per_epoch = None

    def epoch(self, step: int) -> float:
        return float(self._positions.get(step, (0, 0, 0))[0])

    def _describe(self) -> dict[str, Any]:
        u = self.units
        out = {
            "kind": "stream" if isinstance(u, StreamUnits) else "map_units",
            "packing": self.packing,
            "seed": u.seed,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
            "process_index": u.process_index,
            "process_count": u.process_count,
            "window": getattr(u, "window", None),
            "num_rows": len(u.source) if isinstance(u, MapUnits) else None,
        }
        if self.unit_packer is not None:
            out["packing"] = "units"
        if self.packing:  # how rows are built is part of where a resume stands
            c = self.collation
            out["packing_window"] = self.packing_window
            out["long_documents"] = "split" if self.split_long_documents else c.truncation_mode
        return out

    def data_state(self, step: int) -> dict[str, Any]:
        """JSON-able position of this process's stream before ``step`` (a recent step)."""
        if step not in self._positions:
            raise ValueError(
                f"the data position of step {step} is not known (only the last {self.history} "
                "steps the loader produced are kept)"
            )
        epoch, offset, row = self._positions[step]
        described = self._describe()
        return {**described, "step": int(step), "epoch": epoch, "offset": offset, "row": row}

    def check_data_state(self, state: dict[str, Any]) -> int:
        """Validate a saved state and resume from it at the next ``batches(step)`` call.

        Multi-host checkpoints may store every process's state as
        ``{"step": k, "processes": [data_state of process 0, 1, ...]}``; each process then
        takes its own entry.
        """
        if "processes" in state:
            mine = self.units.process_index
            if len(state["processes"]) != self.units.process_count:
                raise DatasetError(
                    f"The checkpoint's data position was saved by {len(state['processes'])} "
                    f"processes, this run has {self.units.process_count}; resume with the same "
                    "number of processes"
                )
            state = state["processes"][mine]
        check_same_data(state, {**self._describe(), "step": 0})
        step = int(state["step"])
        self._positions[step] = (int(state["epoch"]), int(state["offset"]), int(state["row"]))
        return step

    def _start(self, start_step: int) -> tuple[int, int, int] | None:
        if start_step in self._positions:
            return self._positions[start_step]
        return None

    def batches(self, start_step: int = 0, *, with_stats: bool = False) -> Iterator[Any]:
        """Endless batches from ``start_step``. A step > 0 resumes from the position stored
        by ``check_data_state`` (or seen earlier); otherwise the stream is replayed from the
        start and the first ``start_step`` batches are discarded (exact, but slow)."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        position = self._start(start_step)
        replay = 0
        if position is None:
            position, replay = (0, 0, 0), start_step
        stream = _Peek(self.units.iterate(position[:2]))
        packer = None
        if self.packing:
            c = self.collation
            packer = Packer(
                _PeekIter(stream),
                seq_len=c.seq_len,
                pad_token_id=c.pad_token_id,
                truncation_mode=c.truncation_mode,
                split_long=self.split_long_documents,
                window=self.packing_window,
                seed=self.units.seed,
                shuffle=self.units.shuffle,
                skip_rows=position[2],
                image_slots=self.image_slots,
            )
        step = start_step - replay
        while True:
            fresh = step == 0
            batch, stats, after = self._step(stream, packer, fresh)
            step += 1
            self._positions[step] = after
            self._positions.pop(step - self.history, None)
            if step > start_step:
                yield (batch, stats) if with_stats else batch

    def _step(self, stream: _Peek, packer: Packer | None, fresh: bool):
        a = self.accumulation_steps
        n = self.rows_per_step
        if self.unit_packer is not None:
            start_epoch = stream.position()[0]
            micro = [self.unit_packer(stream) for _ in range(a)]
            batch = {k: np.stack([m[0][k] for m in micro]) for k in micro[0][0]}
            stats = sum((m[1] for m in micro), CollateStats())
            after = (*stream.position(), 0)  # the first unit no micro-batch took
            if fresh and stream.last[0] > start_epoch:
                raise DatasetError(
                    f"{self.name} has fewer rows (per process) than one step of packed units "
                    f"takes; add data or lower total_batch_size"
                )
            return batch, stats, after
        if packer is not None:
            start_epoch = packer.position()[0]
            rows, truncated, padding = [], 0, 0
            for _ in range(n):
                row, row_stats = packer.next_row()
                rows.append(row)
                truncated += row_stats.num_truncated_tokens
                padding += row_stats.num_padding_tokens
            stats = CollateStats(truncated, padding)
            if n == 1:  # a mixture reads its sources a row a step: a view of it, not a copy
                flat = {k: v[None] for k, v in rows[0].items()}
            else:
                flat = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
            crossed = packer.last_epoch > start_epoch
            self.last_epoch = packer.last_epoch
            after = packer.position()  # the start of the next block once this one is used
        else:
            start_epoch = stream.position()[0]
            taken = [stream.take() for _ in range(n)]
            examples = [ex for _, ex in taken]
            where = [off for (_, off), _ in taken]
            flat, stats = self.collation(examples, np.zeros(n, bool), where)
            (last_epoch, last_offset), _ = taken[-1]
            # No look-ahead (a one-shot iterator must not be read past its last row): the
            # position one past the last document; an epoch's end rolls over on resume.
            after = (last_epoch, last_offset + 1, 0)
            crossed = last_epoch > start_epoch
            self.last_epoch = last_epoch
        if fresh and crossed:
            raise DatasetError(
                f"{self.name} has fewer documents (per process) than one global batch of "
                f"{self.global_batch_size} rows needs; add data or lower total_batch_size"
            )
        batch = {k: v.reshape((a, n // a) + v.shape[1:]) for k, v in flat.items()}
        return batch, stats, after


class _PeekIter:
    """Iterator view of a _Peek for the Packer (which keeps its own look-ahead)."""

    def __init__(self, peek: _Peek) -> None:
        self._peek = peek

    def __iter__(self) -> _PeekIter:
        return self

    def __next__(self) -> tuple[Position, dict[str, Any]]:
        return self._peek.take()
