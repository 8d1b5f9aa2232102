"""Dataset validation, deterministic resumable train batches, exact eval batches, prefetch.

The train stream is a pure function of (seed, step): the permutation of epoch ``e`` is drawn
from ``(seed, e)`` alone, so resuming at step k needs no replay and yields exactly what an
uninterrupted run would. The data position to checkpoint is therefore just the step.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from jaxtrain.data.collate import (
    IGNORE_INDEX,
    TRUNCATION_MODES,
    CollateStats,
    collate_examples,
)

__all__ = [
    "BatchLoader",
    "DatasetError",
    "eval_batches",
    "num_eval_batches",
    "validate_dataset",
]

Batch = dict[str, np.ndarray]
Collator = Callable[[list[dict[str, Any]]], Mapping[str, Any]]
T = TypeVar("T")
_FILL = -1  # index marking a fill row (fully masked) in a batch's index vector


class DatasetError(ValueError):
    """A dataset cannot be used as given; the message names the dataset, column/row and fix."""


def is_hf_dataset(obj: Any) -> bool:
    """True for a `datasets.Dataset`, without importing `datasets` (a second of start-up).

    An object can only be a Dataset if the caller has imported the library already.
    """
    module = sys.modules.get("datasets")
    return module is not None and isinstance(obj, module.Dataset)


def _columns(dataset: Any) -> list[str]:
    if is_hf_dataset(dataset):
        return list(dataset.column_names)
    first = dataset[0]
    return sorted(first) if isinstance(first, Mapping) else []


def _is_int_sequence(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return value.ndim == 1 and (np.issubdtype(value.dtype, np.integer) or value.size == 0)
    if not isinstance(value, (list, tuple)):
        return False
    return all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)


def validate_dataset(
    dataset: Any,
    *,
    name: str,
    tokenizer: Any = None,
    text_column: str = "text",
    min_rows: int = 1,
) -> str:
    """Check a ``datasets.Dataset`` or list of dicts before anything is compiled.

    Returns ``"input_ids"`` (pre-tokenized rows, preferred when both exist) or ``"text"``
    (rows tokenized lazily). Raises ``DatasetError`` naming ``name``, the columns and the fix.
    """
    if not (is_hf_dataset(dataset) or isinstance(dataset, Sequence)) or isinstance(
        dataset, (str, bytes)
    ):
        raise DatasetError(
            f"{name} must be a datasets.Dataset or a list of dicts, got {type(dataset).__name__}"
        )
    n = len(dataset)
    if n == 0:
        raise DatasetError(f"{name} is empty (0 rows); pass a dataset with at least one row")
    if not is_hf_dataset(dataset) and not isinstance(dataset[0], Mapping):
        raise DatasetError(
            f"{name} row 0 is a {type(dataset[0]).__name__}, expected a dict such as "
            f"{{'input_ids': [...]}} or {{{text_column!r}: '...'}}"
        )
    columns = _columns(dataset)
    if "input_ids" in columns:
        value = dataset[0]["input_ids"]
        if not _is_int_sequence(value):
            raise DatasetError(
                f"{name} column 'input_ids' must hold sequences of ints (token ids); row 0 has "
                f"{type(value).__name__}: {str(value)[:60]!r}. Available columns: {columns}. "
                f"Put raw text in the {text_column!r} column and pass processing_class=<tokenizer>"
            )
        mode = "input_ids"
    elif text_column in columns:
        if tokenizer is None:
            raise DatasetError(
                f"{name} has a text column {text_column!r} but no tokenizer was given; "
                "pass processing_class=<tokenizer> (or pre-tokenize into an 'input_ids' column)"
            )
        mode = "text"
    else:
        raise DatasetError(
            f"{name} has neither an 'input_ids' column nor the text column {text_column!r}; "
            f"available columns: {columns}. Set the text column name (text_column=...) or "
            "tokenize the data into 'input_ids'"
        )
    if n < min_rows:
        raise DatasetError(
            f"{name} has {n} rows but one global batch needs {min_rows} rows "
            f"(total_batch_size={min_rows}); lower total_batch_size to at most {n} or add data"
        )
    return mode


class _Assembler:
    """Turns a vector of row indices (``_FILL`` = fully masked filler) into one batch."""

    def __init__(
        self,
        dataset: Any,
        *,
        name: str,
        seq_len: int,
        pad_token_id: int | None,
        truncation_mode: str,
        tokenizer: Any,
        text_column: str,
        collator: Collator | None,
        min_rows: int,
    ) -> None:
        if not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if truncation_mode not in TRUNCATION_MODES:
            raise ValueError(
                f"truncation_mode={truncation_mode!r} is not supported; use one of "
                f"{TRUNCATION_MODES}"
            )
        if collator is None and not isinstance(pad_token_id, (int, np.integer)):
            raise ValueError(
                f"pad_token_id must be an int, got {pad_token_id!r}; if the tokenizer has no pad "
                "token, set one (e.g. tokenizer.pad_token = tokenizer.eos_token)"
            )
        self.mode = validate_dataset(
            dataset, name=name, tokenizer=tokenizer, text_column=text_column, min_rows=min_rows
        )
        self.dataset, self.name, self.tokenizer = dataset, name, tokenizer
        self.seq_len, self.pad_token_id = seq_len, pad_token_id
        self.truncation_mode = truncation_mode
        self.text_column, self.collator = text_column, collator

    def _rows(self, indices: list[int]) -> list[dict[str, Any]]:
        if not indices:
            return []
        if is_hf_dataset(self.dataset):
            cols = self.dataset[indices]  # one columnar read for the whole batch
            return [{k: v[i] for k, v in cols.items()} for i in range(len(indices))]
        return [dict(self.dataset[i]) for i in indices]

    def _tokenize(self, rows: list[dict[str, Any]], indices: list[int]) -> None:
        texts = []
        for row, idx in zip(rows, indices):
            text = row.get(self.text_column)
            if not isinstance(text, str):
                raise DatasetError(
                    f"{self.name} row {idx}: column {self.text_column!r} is "
                    f"{type(text).__name__}, expected str; fix or drop that row"
                )
            texts.append(text)
        try:
            encoded = self.tokenizer(texts)["input_ids"]
        except Exception:
            # Find the culprit row so the error can name it.
            for text, idx in zip(texts, indices):
                try:
                    self.tokenizer([text])
                except Exception as exc:
                    raise DatasetError(
                        f"{self.name} row {idx}: the tokenizer failed on column "
                        f"{self.text_column!r}: {exc}"
                    ) from exc
            raise
        for row, ids in zip(rows, encoded):
            row["input_ids"] = ids

    def _collate(
        self, examples: list[dict[str, Any]], indices: list[int]
    ) -> tuple[Batch, CollateStats]:
        try:
            return collate_examples(
                examples,
                seq_len=self.seq_len,
                pad_token_id=self.pad_token_id,
                truncation_mode=self.truncation_mode,
                return_stats=True,
            )
        except ValueError as exc:
            for example, idx in zip(examples, indices):
                try:
                    collate_examples([example], seq_len=self.seq_len, pad_token_id=0)
                except ValueError as row_exc:
                    raise DatasetError(f"{self.name} row {idx}: {row_exc}") from row_exc
            raise DatasetError(f"{self.name}: {exc}") from exc

    def _user_collate(self, examples: list[dict[str, Any]], fill: np.ndarray) -> Batch:
        out = self.collator(examples)
        if not isinstance(out, Mapping):
            raise ValueError(f"collator must return a dict of arrays, got {type(out).__name__}")
        batch = {k: np.asarray(v) for k, v in out.items()}
        for key, value in batch.items():
            if value.ndim == 0 or value.shape[0] != len(examples):
                raise ValueError(
                    f"collator output {key!r} has shape {value.shape}; its leading dimension "
                    f"must equal the number of examples ({len(examples)})"
                )
        if fill.any():
            if "labels" not in batch:
                raise ValueError(
                    "collator output has no 'labels', so filler rows cannot be masked out; "
                    "return 'labels' (with -100 for ignored positions)"
                )
            batch["labels"] = batch["labels"].copy()
            batch["labels"][fill] = IGNORE_INDEX
            if "attention_mask" in batch:
                batch["attention_mask"] = batch["attention_mask"].copy()
                batch["attention_mask"][fill] = 0
        return batch

    def __call__(self, indices: np.ndarray) -> tuple[Batch, CollateStats | None]:
        """Batch for ``indices`` (leading dim = len(indices)); stats are None with a collator."""
        fill = indices == _FILL
        real = [int(i) for i in indices[~fill]]
        rows = self._rows(real)
        if self.mode == "text":
            self._tokenize(rows, real)
        if self.collator is None:
            # An empty example collates to an all-pad, all-masked row: exactly a filler row.
            it = iter(rows)
            examples = [{"input_ids": []} if f else next(it) for f in fill]
            ordered = [_FILL if f else i for f, i in zip(fill, indices)]
            return self._collate(examples, ordered)
        # User collators get real rows; fillers are copies of one real row, masked afterwards.
        if fill.any():
            template = rows[0] if rows else self._rows([0])[0]
            if not rows and self.mode == "text":
                self._tokenize([template], [0])
            it = iter(rows)
            rows = [dict(template) if f else next(it) for f in fill]
        return self._user_collate(rows, fill), None


def _local_columns(index_matrix: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """This host's slice of the per-micro-batch rows: [..., M] -> [..., M // process_count]."""
    per = index_matrix.shape[-1] // process_count
    return index_matrix[..., process_index * per : (process_index + 1) * per]


def _check_processes(process_index: int, process_count: int, rows_per_batch: int, what: str):
    if process_count <= 0 or not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index={process_index} must be in [0, process_count={process_count})"
        )
    if rows_per_batch % process_count:
        raise ValueError(
            f"{what}={rows_per_batch} rows are split over process_count={process_count} hosts; "
            f"make it a multiple of {process_count}"
        )


class BatchLoader:
    """Infinite, deterministic, resumable train batches shaped ``[A, M, seq_len]``.

    ``A = accumulation_steps``, ``M = global_batch_size // A``. With ``process_count > 1``
    each host gets only its ``[A, M // process_count, seq_len]`` slice (rows
    ``[p*m, (p+1)*m)`` of every micro-batch) and reads only those rows.
    With ``drop_last=False`` the last batch of an epoch is completed with fully masked rows
    (labels -100, attention_mask 0) so shapes never change.
    """

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
    ) -> None:
        if global_batch_size <= 0 or accumulation_steps <= 0:
            raise ValueError(
                f"total_batch_size ({global_batch_size}) and gradient_accumulation_steps "
                f"({accumulation_steps}) must be positive"
            )
        if global_batch_size % accumulation_steps:
            raise ValueError(
                f"total_batch_size={global_batch_size} is not divisible by "
                f"gradient_accumulation_steps={accumulation_steps}; make it a multiple"
            )
        micro = global_batch_size // accumulation_steps
        _check_processes(process_index, process_count, micro, "micro-batch size")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self._assemble = _Assembler(
            dataset,
            name=name,
            seq_len=seq_len,
            pad_token_id=pad_token_id,
            truncation_mode=truncation_mode,
            tokenizer=tokenizer,
            text_column=text_column,
            collator=collator,
            min_rows=global_batch_size if drop_last else 1,
        )
        self.num_rows = len(dataset)
        self.global_batch_size, self.accumulation_steps = global_batch_size, accumulation_steps
        self.micro_batch_size, self.seq_len = micro, seq_len
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.process_index, self.process_count = process_index, process_count
        self._perm_cache: tuple[int, np.ndarray] | None = None

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_rows // self.global_batch_size
        return -(-self.num_rows // self.global_batch_size)

    def epoch_of_step(self, step: int) -> int:
        return step // self.steps_per_epoch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
            else:
                perm = np.arange(self.num_rows)
            self._perm_cache = (epoch, perm)
        return self._perm_cache[1]

    def global_indices(self, step: int) -> np.ndarray:
        """Dataset rows of the whole global batch at ``step``, shape [A, M] (-1 = filler)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, within = divmod(step, self.steps_per_epoch)
        g = self.global_batch_size
        idx = self._permutation(epoch)[within * g : (within + 1) * g]
        idx = np.concatenate([idx, np.full(g - len(idx), _FILL, idx.dtype)])
        return idx.reshape(self.accumulation_steps, self.micro_batch_size)

    def batch_at(self, step: int) -> tuple[Batch, CollateStats | None]:
        """This host's batch for ``step`` and its collate stats (None with a user collator)."""
        local = _local_columns(self.global_indices(step), self.process_index, self.process_count)
        flat, stats = self._assemble(local.reshape(-1))
        return {k: v.reshape(local.shape + v.shape[1:]) for k, v in flat.items()}, stats

    def data_state(self, step: int) -> dict[str, Any]:
        """JSON-able position to resume from so that the next batch is the one of ``step``.

        Checkpoints store it; ``check_data_state`` refuses a state from another dataset.
        Here the stream is a pure function of (seed, step), so the step is the position.
        """
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
        mine = self.data_state(state.get("step", 0))
        differing = [k for k in mine if k != "step" and state.get(k) != mine[k]]
        if differing:
            details = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in differing)
            raise DatasetError(
                f"The checkpoint's data position does not fit dataset_train ({details}). "
                "Resume with the same dataset, seed and batch size, or start a new run."
            )
        return int(state["step"])

    def batches(self, start_step: int = 0, *, with_stats: bool = False) -> Iterator[Any]:
        """Endless batches from ``start_step`` on (epochs roll over); yields ``batch`` or
        ``(batch, CollateStats | None)`` with ``with_stats=True``."""
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        for step in itertools.count(start_step):
            batch, stats = self.batch_at(step)
            yield (batch, stats) if with_stats else batch


def num_eval_batches(dataset: Any, *, batch_size: int) -> int:
    """How many batches ``eval_batches`` yields: ceil(rows / batch_size)."""
    if batch_size <= 0:
        raise ValueError(f"eval batch_size must be positive, got {batch_size}")
    return -(-len(dataset) // batch_size)


def eval_batches(
    dataset: Any,
    *,
    batch_size: int,
    seq_len: int,
    pad_token_id: int | None,
    truncation_mode: str = "keep_end",
    tokenizer: Any = None,
    text_column: str = "text",
    collator: Collator | None = None,
    process_index: int = 0,
    process_count: int = 1,
    name: str = "dataset_eval",
    with_stats: bool = False,
) -> Iterator[Any]:
    """Every eval row exactly once, in order, in ``[batch_size, seq_len]`` batches.

    The last batch is completed with filler rows (labels -100, attention_mask 0), so shapes
    are fixed and a token-weighted loss over all batches is exact. With
    ``process_count > 1`` each host yields its ``batch_size // process_count`` slice.
    """
    n_batches = num_eval_batches(dataset, batch_size=batch_size)
    _check_processes(process_index, process_count, batch_size, "eval batch_size")
    assemble = _Assembler(
        dataset,
        name=name,
        seq_len=seq_len,
        pad_token_id=pad_token_id,
        truncation_mode=truncation_mode,
        tokenizer=tokenizer,
        text_column=text_column,
        collator=collator,
        min_rows=1,
    )
    n = len(dataset)

    def generate() -> Iterator[Any]:
        for b in range(n_batches):
            idx = np.arange(b * batch_size, (b + 1) * batch_size)
            idx[idx >= n] = _FILL
            batch, stats = assemble(_local_columns(idx, process_index, process_count))
            yield (batch, stats) if with_stats else batch

    # Validation above runs eagerly; only batch building is lazy.
    return generate()
