"""Small local jsonl and txt files read straight into an Arrow table, without `datasets`.

``datasets.load_dataset("json" | "text", ...)`` reads such files with pyarrow too, but
importing `datasets` (with pandas and scipy.io) and writing its Arrow cache took 0.7 s of
the 3.6 s from launch to the first step of `jaxtrain train` on the 6.3M model
(bench/RESULTS.md, 2026-11-26). Files of up to SMALL_FILES_BYTES in all are read here into
memory, the same rows and columns (``tests/data/test_arrow_rows.py`` compares them with
`datasets`' own); bigger ones, other formats and files pyarrow cannot read as they are go
through `datasets` (memory-mapped, its messages).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from jaxtrain.data.errors import DatasetError

__all__ = ["SMALL_FILES_BYTES", "ArrowRows", "read_small_files"]

SMALL_FILES_BYTES = 256 * 2**20
# pyarrow's word for a .jsonl column whose rows disagree on their type.
MIXED_TYPES = re.compile(r"Column\(/([^)]*)\) changed from (\w+) to (\w+) in row (\d+)")


class ArrowRows(Sequence):
    """The rows of an in-memory ``pyarrow.Table`` as a sequence of dicts (a list of rows to
    everything that reads datasets); ``table`` for vectorised reads such as scan.py's."""

    def __init__(self, table: Any) -> None:
        self.table = table

    @property
    def column_names(self) -> list[str]:
        return list(self.table.column_names)

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = index + len(self) if index < 0 else index
        if not 0 <= i < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        return self.table.slice(i, 1).to_pylist()[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.table.to_batches():
            yield from batch.to_pylist()

    def rows(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Rows at `indices`, in that order, in one read."""
        return self.table.take(list(indices)).to_pylist()

    def __repr__(self) -> str:
        return f"ArrowRows(rows={len(self)}, columns={self.column_names})"


def read_small_files(builder: str, paths: list[str]) -> ArrowRows | None:
    """The rows of `paths` (one format: "json" for .jsonl, "text" for .txt), or None when
    they are not small jsonl/txt files or pyarrow cannot read them as they are."""
    suffix = {"json": ".jsonl", "text": ".txt"}.get(builder)
    if suffix is None or any(Path(p).suffix.lower() != suffix for p in paths):
        return None  # .json may be one JSON document, not lines: datasets reads those
    if sum(os.path.getsize(p) for p in paths) > SMALL_FILES_BYTES:
        return None
    import pyarrow as pa

    read = _read_jsonl if builder == "json" else _read_text
    tables = []
    for path in paths:
        try:
            tables.append(read(path))
        except (pa.ArrowException, UnicodeDecodeError, ValueError) as err:
            mixed = MIXED_TYPES.search(str(err))
            if mixed:  # datasets would read it through pandas, which turns " 3" into 3
                column, was, now, row = mixed.groups()
                raise DatasetError(
                    f"{path}: column {column!r} holds {was}s, then a {now} in row {row}: a "
                    f"column holds one type; fix that row (quote a number meant as text)"
                ) from None
            return None  # datasets reads it, or names the file and the problem
    if any(t.schema != tables[0].schema for t in tables[1:]) or not tables[0].num_columns:
        return None  # datasets decides how the files' columns combine
    return ArrowRows(pa.concat_tables(tables) if len(tables) > 1 else tables[0])


def _read_jsonl(path: str) -> Any:
    import pyarrow.json as pa_json

    # One block for the whole file: a row longer than a block is an error in pyarrow.
    block = max(os.path.getsize(path), 1 << 20)
    return pa_json.read_json(path, read_options=pa_json.ReadOptions(block_size=block))


def _read_text(path: str) -> Any:
    """One row per line, column "text", without its line break: `datasets`' text builder
    (universal newlines, then lines split at "\\n" only)."""
    import pyarrow as pa

    with open(path, encoding="utf-8") as handle:
        lines = [line.rstrip("\n") for line in io.StringIO(handle.read()).readlines()]
    return pa.table({"text": pa.array(lines, pa.string())})
