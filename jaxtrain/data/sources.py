"""One abstraction over every accepted input: random-access or iterable row sources.

``as_source`` turns what a user passes as ``dataset_train``/``dataset_eval`` into either

- a ``RandomAccessSource`` (``len`` + ``read(indices)``): HF ``datasets.Dataset``, Grain
  ``MapDataset``, TFDS array-record data sources, lists/tuples of dicts, local files
  (``ArrowRows`` for small jsonl/txt ones); or
- an ``IterableSource`` (``iterate(process_index, process_count, skip)``): HF
  ``IterableDataset`` (streaming), Grain ``IterDataset``, any re-iterable of dicts.

Everything downstream (featurize, shuffle, pack, batch) is written once against these two.
Libraries are never imported here unless the user already imported them (``sys.modules``).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxtrain.data.arrow_rows import ArrowRows
from jaxtrain.data.errors import DatasetError

__all__ = ["IterableSource", "RandomAccessSource", "as_source", "is_hf_dataset"]

Row = dict[str, Any]


def _instance_of(obj: Any, module: str, *names: str) -> bool:
    mod = sys.modules.get(module)
    return mod is not None and any(
        isinstance(obj, cls) for cls in (getattr(mod, n, None) for n in names) if cls is not None
    )


def is_hf_dataset(obj: Any) -> bool:
    """True for a `datasets.Dataset`, without importing `datasets` (a second of start-up)."""
    return _instance_of(obj, "datasets", "Dataset")


def is_hf_iterable(obj: Any) -> bool:
    return _instance_of(obj, "datasets", "IterableDataset")


def _as_row(row: Any, *, name: str, where: str) -> Row:
    if isinstance(row, Mapping):
        return dict(row)
    raise DatasetError(
        f"{name} {where} is a {type(row).__name__}, expected a dict such as "
        "{'input_ids': [...]} or {'text': '...'}"
    )


class RandomAccessSource:
    """Rows addressable by index; each host reads only the indices it is given."""

    random_access = True

    def __init__(self, data: Any, *, name: str) -> None:
        self.data, self.name = data, name
        self._hf = is_hf_dataset(data)
        self._arrow_rows = isinstance(data, ArrowRows)
        self._len = len(data)

    def __len__(self) -> int:
        return self._len

    @property
    def is_hf(self) -> bool:
        """A `datasets.Dataset` (an Arrow table), not a list of rows."""
        return self._hf

    @property
    def columns(self) -> list[str] | None:
        if self._hf or self._arrow_rows:
            return list(self.data.column_names)
        return None

    def arrow_table(self, columns: list[str]) -> Any:
        """These columns of every row as one pyarrow Table, in row order, when the rows are
        held in Arrow (a `datasets.Dataset`, ``ArrowRows``); else None."""
        stored = self.arrow_storage(columns)
        if stored is None:
            return None
        table, order = stored
        return table if order is None else table.take(order)

    def arrow_storage(self, columns: list[str]) -> tuple[Any, Any] | None:
        """(these columns as a pyarrow Table in storage order, the stored row of each row
        of the dataset or None when they are the same) when the rows are held in Arrow;
        else None. A dataset's own `with_format("arrow")[:]` of a shuffled million rows
        took 150 s; a take of the order is a fraction of a second, and no take is none."""
        if self._hf:
            indices = getattr(self.data, "_indices", None)  # a shuffle's or select's order
            order = None if indices is None else indices.column(0).to_numpy()
            return self.data.data.table.select(columns), order
        if self._arrow_rows:
            return self.data.table.select(columns), None
        return None

    def read(self, indices: Sequence[int]) -> list[Row]:
        if not len(indices):
            return []
        if self._hf:
            cols = self.data[list(indices)]  # one columnar read for the whole batch
            return [{k: v[i] for k, v in cols.items()} for i in range(len(indices))]
        if self._arrow_rows:
            return self.data.rows(indices)
        return [_as_row(self.data[int(i)], name=self.name, where=f"row {i}") for i in indices]


class IterableSource:
    """Rows in a fixed order, read front to back; re-iterated from the start each epoch.

    ``iterate(p, P, skip)`` yields this host's rows (every P-th row starting at p, or the
    shards HF assigns to node p) after skipping ``skip`` of them.
    """

    random_access = False

    def __init__(self, data: Any, *, name: str) -> None:
        self.data, self.name = data, name
        # A one-shot iterator (a generator) can be read once: no peeking, no second epoch.
        self.one_shot = iter(data) is data if not is_hf_iterable(data) else False
        self._used = False

    def iterate(
        self, process_index: int = 0, process_count: int = 1, skip: int = 0
    ) -> Iterator[Row]:
        data = self.data
        if is_hf_iterable(data):
            if process_count > 1:
                from datasets.distributed import split_dataset_by_node

                data = split_dataset_by_node(data, rank=process_index, world_size=process_count)
            if skip:
                data = data.skip(skip)
            rows: Iterable[Any] = data
            start = skip
        else:
            if self.one_shot and self._used:
                raise DatasetError(
                    f"{self.name} is a one-shot iterator ({type(data).__name__}) and was read "
                    "to its end already; a second epoch or a resume needs a re-iterable source "
                    "(a list, a datasets.IterableDataset, a grain IterDataset or an object whose "
                    "__iter__ starts over)"
                )
            self._used = True
            rows = itertools.islice(iter(data), process_index, None, process_count)
            rows = itertools.islice(rows, skip, None)
            start = skip
        for i, row in enumerate(rows, start):
            yield _as_row(row, name=self.name, where=f"row {i} (of process {process_index})")

    def first_row(self) -> Row | None:
        if self.one_shot:
            return None  # peeking would consume it
        for row in self.iterate():
            return row
        return None


def as_source(
    data: Any, *, name: str, streaming: bool = False
) -> RandomAccessSource | IterableSource:
    """Wrap any accepted input; raises DatasetError naming ``name`` for anything else."""
    if isinstance(data, (RandomAccessSource, IterableSource)):
        return data
    if isinstance(data, (str, Path)) or (
        isinstance(data, (list, tuple)) and data and all(isinstance(d, (str, Path)) for d in data)
    ):
        from jaxtrain.data.files import load_files

        return as_source(load_files(data, name=name, streaming=streaming), name=name)
    if is_hf_dataset(data):
        if streaming:
            return IterableSource(data.to_iterable_dataset(), name=name)
        return RandomAccessSource(data, name=name)
    if is_hf_iterable(data) or _instance_of(data, "grain", "IterDataset"):
        return IterableSource(data, name=name)
    if isinstance(data, (bytes, Mapping)):
        raise DatasetError(
            f"{name} must be a dataset (datasets.Dataset/IterableDataset, grain dataset, list of "
            f"dicts, iterable of dicts or a path/glob of files), got {type(data).__name__}"
        )
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        source = RandomAccessSource(data, name=name)
        return IterableSource(_Reiterable(source), name=name) if streaming else source
    if isinstance(data, Iterable):
        return IterableSource(data, name=name)
    raise DatasetError(
        f"{name} must be a dataset (datasets.Dataset/IterableDataset, grain dataset, list of "
        f"dicts, iterable of dicts or a path/glob of files), got {type(data).__name__}"
    )


class _Reiterable:
    """A random-access source read front to back (``streaming=True`` on in-memory data)."""

    def __init__(self, source: RandomAccessSource) -> None:
        self.source = source

    def __iter__(self) -> Iterator[Row]:
        for start in range(0, len(self.source), 256):
            yield from self.source.read(range(start, min(start + 256, len(self.source))))
