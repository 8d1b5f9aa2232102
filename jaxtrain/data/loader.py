"""Train batch loaders: deterministic, resumable, per-process.

Two loaders share one interface (``steps_per_epoch``, ``epoch(step)``, ``batches(start_step,
with_stats=...)``, ``data_state(step)``, ``check_data_state(state)``):

- ``BatchLoader``: a random-access dataset, one row per sequence. Step k's rows are a pure
  function of (seed, k): the permutation of epoch e is drawn from ``(seed, e)`` alone, so
  resuming at step k reads nothing twice and the data position is just the step.
- ``UnitLoader``: packing and/or streaming. Documents come from a unit stream
  (``units.MapUnits``/``streams.StreamUnits``) in a fixed order; the position
  ``(epoch, offset, row)`` after each step is recorded, checkpointed, and resumed from
  (``row``: rows of the packing block at ``offset`` already used; 0 without packing).

Batches are ``[A, M // process_count, seq_len]`` on each host (A = accumulation steps,
M = global batch // A): host p gets rows ``[p*m, (p+1)*m)`` of every micro-batch and reads
only its own rows (map-style) or its own part of the stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from jaxtrain.config.tables import check_divisible
from jaxtrain.data.assemble import Batch, Collation, Collator
from jaxtrain.data.collate import CollateStats
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.packing import PACKED_FIELDS, Packer
from jaxtrain.data.sources import IterableSource, RandomAccessSource, as_source
from jaxtrain.data.streams import StreamUnits
from jaxtrain.data.units import MapUnits, Position, epoch_order

__all__ = ["BatchLoader", "DatasetError", "UnitLoader", "prepare_source", "validate_dataset"]

_FILL = -1  # index marking a fill row (fully masked) in a batch's index vector
_HISTORY = 256  # steps whose data position UnitLoader remembers (prefetch runs ahead)


def prepare_source(
    source: RandomAccessSource | IterableSource, featurizer: Featurizer, *, min_rows: int = 1
) -> str:
    """Check a source before anything is compiled; returns the row kind (see Featurizer)."""
    name = source.name
    if isinstance(source, RandomAccessSource):
        n = len(source)
        if n == 0:
            raise DatasetError(f"{name} is empty (0 rows); pass a dataset with at least one row")
        mode = featurizer.detect(source.read([0])[0], source.columns)
        if n < min_rows:
            raise DatasetError(
                f"{name} has {n} rows but one global batch needs {min_rows} rows "
                f"(total_batch_size={min_rows}); lower total_batch_size to at most {n} or add data"
            )
        return mode
    first = source.first_row()
    if first is None:
        if source.one_shot:
            return "unknown"  # decided at the first row read
        raise DatasetError(f"{name} is empty (no rows); pass a dataset with at least one row")
    return featurizer.detect(first)


def validate_dataset(
    dataset: Any,
    *,
    name: str,
    tokenizer: Any = None,
    text_column: str = "text",
    min_rows: int = 1,
) -> str:
    """Check a dataset of any accepted kind; returns "input_ids", "text" or "messages"."""
    featurizer = Featurizer(name=name, tokenizer=tokenizer, text_column=text_column)
    return prepare_source(as_source(dataset, name=name), featurizer, min_rows=min_rows)


def _check_batch(global_batch_size: int, accumulation_steps: int) -> int:
    if global_batch_size <= 0 or accumulation_steps <= 0:
        raise ValueError(
            f"total_batch_size ({global_batch_size}) and gradient_accumulation_steps "
            f"({accumulation_steps}) must be positive"
        )
    return check_divisible(
        global_batch_size,
        accumulation_steps,
        what="total_batch_size",
        over="gradient_accumulation_steps",
    )


def check_processes(process_index: int, process_count: int, rows: int, what: str) -> None:
    if process_count <= 0 or not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index={process_index} must be in [0, process_count={process_count})"
        )
    check_divisible(rows, process_count, what=what, over="process_count")


def _check_seed(seed: Any) -> int:
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return int(seed)


def _mismatch(state: dict[str, Any], mine: dict[str, Any]) -> None:
    differing = [
        k for k in mine if k not in ("step", "epoch", "offset", "row") and state.get(k) != mine[k]
    ]
    if differing:
        details = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in differing)
        raise DatasetError(
            f"The checkpoint's data position does not fit dataset_train ({details}). "
            "Resume with the same dataset, seed, batch size and data options, or start a new run."
        )


class BatchLoader:
    """Endless, deterministic, resumable batches of a random-access dataset (no packing).

    With ``drop_last=True`` an epoch is ``rows // global_batch_size`` steps and the rest of
    the shuffled rows is skipped that epoch (other rows are skipped the next). With
    ``drop_last=False`` the last batch of an epoch is completed with fully masked rows
    (labels -100, attention_mask 0) so shapes never change and every row is seen.
    """

    # The position is a function of the step, the same on every process.
    state_is_per_process = False

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch_size: int,
        accumulation_steps: int,
        seq_len: int,
        pad_token_id: int | None,
        truncation_mode: str = "keep_end",
        shuffle: bool = True,
        seed: int = 0,
        tokenizer: Any = None,
        text_column: str = "text",
        collator: Collator | None = None,
        drop_last: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        name: str = "dataset_train",
        featurizer: Featurizer | None = None,
    ) -> None:
        micro = _check_batch(global_batch_size, accumulation_steps)
        check_processes(process_index, process_count, micro, "micro-batch size")
        self.seed = _check_seed(seed)
        self.collation = Collation(
            name=name,
            seq_len=seq_len,
            pad_token_id=pad_token_id,
            truncation_mode=truncation_mode,
            collator=collator,
        )
        self.source = as_source(dataset, name=name)
        if not isinstance(self.source, RandomAccessSource):
            raise DatasetError(f"{name} is not random-access; use UnitLoader (streaming)")
        self.featurizer = featurizer or Featurizer(
            name=name, tokenizer=tokenizer, text_column=text_column
        )
        self.mode = prepare_source(
            self.source, self.featurizer, min_rows=global_batch_size if drop_last else 1
        )
        self.num_rows = len(self.source)
        self.global_batch_size, self.accumulation_steps = global_batch_size, accumulation_steps
        self.micro_batch_size, self.seq_len = micro, seq_len
        self.shuffle, self.drop_last = shuffle, drop_last
        self.process_index, self.process_count = process_index, process_count
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_rows // self.global_batch_size
        return -(-self.num_rows // self.global_batch_size)

    def epoch(self, step: int) -> float:
        """Epochs completed after ``step`` steps (fractional)."""
        return step / self.steps_per_epoch

    def epoch_of_step(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            order = epoch_order(self.num_rows, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            self._order = (epoch, order)
        return self._order[1]

    def global_indices(self, step: int) -> np.ndarray:
        """Dataset rows of the whole global batch at ``step``, shape [A, M] (-1 = filler)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, within = divmod(step, self.steps_per_epoch)
        g = self.global_batch_size
        idx = self._permutation(epoch)[within * g : (within + 1) * g]
        idx = np.concatenate([idx, np.full(g - len(idx), _FILL, idx.dtype)])
        return idx.reshape(self.accumulation_steps, self.micro_batch_size)

    def local_indices(self, step: int) -> np.ndarray:
        """This host's rows of step ``step``: [A, M // process_count]."""
        per = self.micro_batch_size // self.process_count
        lo = self.process_index * per
        return self.global_indices(step)[:, lo : lo + per]

    def batch_at(self, step: int) -> tuple[Batch, CollateStats | None]:
        """This host's batch for ``step`` and its collate stats (None with a user collator)."""
        local = self.local_indices(step)
        flat, stats = self.rows_of(local.reshape(-1))
        return {k: v.reshape(local.shape + v.shape[1:]) for k, v in flat.items()}, stats

    def rows_at(self, steps: range) -> tuple[Batch, CollateStats | None]:
        """This host's rows of several steps, read and collated at once: [rows, ...] (what
        `local_indices` gives for each step, flattened). A mixture reads a source this way:
        one row per process per step, many steps at a time."""
        if steps.start < 0:
            raise ValueError(f"step must be >= 0, got {steps.start}")
        s = np.arange(steps.start, steps.stop)
        epochs, within = np.divmod(s, self.steps_per_epoch)
        # Each step's rows, as positions in its epoch's order: micro-batch a's columns
        # [lo, lo + per) of that step's global batch (global_indices, then local_indices).
        per = self.micro_batch_size // self.process_count
        lo = self.process_index * per
        columns = np.arange(self.accumulation_steps)[:, None] * self.micro_batch_size + lo
        offsets = (columns + np.arange(per)[None, :]).reshape(-1)
        positions = within[:, None] * self.global_batch_size + offsets[None, :]
        if len(s) and epochs[0] == epochs[-1]:  # within one epoch (most reads): no masks
            order = self._permutation(int(epochs[0]))
            if positions[-1, -1] < len(order):  # the largest position: no filler row
                return self.rows_of(order[positions.reshape(-1)])
        flat = np.full(positions.shape, _FILL, np.int64)
        for epoch in np.unique(epochs):
            order, rows = self._permutation(int(epoch)), epochs == epoch
            at = positions[rows]
            flat[rows] = np.where(at < len(order), order[np.minimum(at, len(order) - 1)], _FILL)
        return self.rows_of(flat.reshape(-1))

    def rows_of(self, flat_idx: np.ndarray) -> tuple[Batch, CollateStats | None]:
        """Rows `flat_idx` of the dataset (-1: a filler row) collated: [len(flat_idx), ...]."""
        fill = flat_idx == _FILL
        real = [int(i) for i in flat_idx[~fill]]
        if not real:  # a batch of fillers only (cannot happen with drop_last) needs a template
            real_rows = self.featurizer(self.source.read([0]), [0])
        else:
            real_rows = self.featurizer(self.source.read(real), real)
        where = [None if f else int(i) for f, i in zip(fill, flat_idx)]
        return self.collation(real_rows, fill, where)

    def data_state(self, step: int) -> dict[str, Any]:
        """JSON-able position to resume from so that the next batch is the one of ``step``."""
        return {
            "kind": "map",
            "step": int(step),
            "seed": self.seed,
            "num_rows": self.num_rows,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
        }

    def check_data_state(self, state: dict[str, Any]) -> int:
        """Validate a saved ``data_state`` against this loader; returns the step to start at."""
        _mismatch(state, self.data_state(state.get("step", 0)))
        return int(state["step"])

    def batches(self, start_step: int = 0, *, with_stats: bool = False) -> Iterator[Any]:
        """Endless batches from ``start_step`` on (epochs roll over); yields ``batch`` or
        ``(batch, CollateStats | None)`` with ``with_stats=True``."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        for step in itertools.count(start_step):
            batch, stats = self.batch_at(step)
            yield (batch, stats) if with_stats else batch


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
    ) -> None:
        micro = _check_batch(global_batch_size, accumulation_steps)
        check_processes(units.process_index, units.process_count, micro, "micro-batch size")
        if packing and collation.collator is not None:
            raise ValueError(
                "packing=True builds its own rows; it cannot be combined with a data_collator. "
                "Drop one of them."
            )
        if packing and packing_window < 1:
            raise ValueError(f"packing_window must be >= 1, got {packing_window}")
        self.units, self.collation, self.packing = units, collation, packing
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
        _mismatch(state, {**self._describe(), "step": 0})
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
                flat = {k: rows[0][k][None] for k in PACKED_FIELDS}
            else:
                flat = {k: np.stack([r[k] for r in rows]) for k in PACKED_FIELDS}
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
