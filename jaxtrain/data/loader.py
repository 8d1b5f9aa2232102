"""Train batch loaders: deterministic, resumable, per-process.

Two loaders share one interface (UnitLoader lives in unit_loader.py) (``steps_per_epoch``, ``epoch(step)``, ``batches(start_step,
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
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from jaxtrain.config.tables import check_divisible
from jaxtrain.data.assemble import Batch, Collation, Collator
from jaxtrain.data.collate import CollateStats
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.images import refuse_unread_images
from jaxtrain.data.row_checks import check_all_rows
from jaxtrain.data.sources import IterableSource, RandomAccessSource, as_source
from jaxtrain.data.units import epoch_order

__all__ = ["BatchLoader", "DatasetError", "prepare_source", "validate_dataset"]

_FILL = -1  # index marking a fill row (fully masked) in a batch's index vector


def prepare_source(
    source: RandomAccessSource | IterableSource, featurizer: Featurizer, *, min_rows: int = 1
) -> str:
    """Check a source before anything is compiled (every row of a map-style one:
    data/row_checks.py); returns the row kind (see Featurizer)."""
    name = source.name
    if isinstance(source, RandomAccessSource):
        n = len(source)
        if n == 0:
            raise DatasetError(f"{name} is empty (0 rows); pass a dataset with at least one row")
        first = source.read([0])[0]
        mode = featurizer.detect(first, source.columns)
        _refuse_images(first, featurizer, name)
        if n < min_rows:
            raise DatasetError(
                f"{name} has {n} rows but one global batch needs {min_rows} rows "
                f"(total_batch_size={min_rows}); lower total_batch_size to at most {n} or add data"
            )
        check_all_rows(source, featurizer)
        return mode
    first = source.first_row()
    if first is None:
        if source.one_shot:
            return "unknown"  # decided at the first row read
        raise DatasetError(f"{name} is empty (no rows); pass a dataset with at least one row")
    mode = featurizer.detect(first)
    _refuse_images(first, featurizer, name)
    return mode


def _refuse_images(first: Any, featurizer: Featurizer, name: str) -> None:
    if not featurizer.takes_images and isinstance(first, Mapping):
        refuse_unread_images(featurizer.drop(dict(first)), name, featurizer.tokenizer)


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


def check_batch(global_batch_size: int, accumulation_steps: int) -> int:
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


def check_same_data(state: dict[str, Any], mine: dict[str, Any]) -> None:
    differing = [
        k for k in mine if k not in ("step", "epoch", "offset", "row") and state.get(k) != mine[k]
    ]
    if differing:
        details = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in differing)
        raise DatasetError(
            f"The checkpoint's data position does not fit dataset_train ({details}). "
            "Resume with the same dataset, seed, batch size and data options (rows of text cut "
            "to max_sequence_length change with it), or start a new run (another output_dir, "
            "or overwrite_output_dir=True)."
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
        micro = check_batch(global_batch_size, accumulation_steps)
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
        check_same_data(state, self.data_state(state.get("step", 0)))
        return int(state["step"])

    def batches(self, start_step: int = 0, *, with_stats: bool = False) -> Iterator[Any]:
        """Endless batches from ``start_step`` on (epochs roll over); yields ``batch`` or
        ``(batch, CollateStats | None)`` with ``with_stats=True``."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        for step in itertools.count(start_step):
            batch, stats = self.batch_at(step)
            yield (batch, stats) if with_stats else batch
