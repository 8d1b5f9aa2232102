"""Local files as datasets: a path, a glob or a list of them; many shards of one format.

jsonl/json, parquet, arrow, csv and txt (one row per line, column ``text``) are read with
the ``datasets`` builders: memory-mapped Arrow (map-style) or, with ``streaming=True``, an
``IterableDataset`` read shard by shard; small jsonl and txt files straight into memory
(arrow_rows.py: the same rows, without importing ``datasets``). A file that cannot be read
is named in the error.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from jaxtrain.data.arrow_rows import read_small_files
from jaxtrain.data.encoding import check_utf8
from jaxtrain.data.errors import DatasetError

__all__ = ["FILE_FORMATS", "load_files", "resolve_files"]

# file suffix -> `datasets` builder
# The formats read as UTF-8 text.
TEXT_BUILDERS = ("json", "csv", "text")
FILE_FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
    ".txt": "text",
}


def resolve_files(pattern: str | Path | Sequence[str | Path], *, name: str) -> list[str]:
    """Sorted paths matched by a path, a glob, or a list of either; one format only."""
    patterns = [pattern] if isinstance(pattern, (str, Path)) else list(pattern)
    paths: list[str] = []
    for p in patterns:
        matched = sorted(glob.glob(str(p), recursive=True))
        if not matched and Path(p).is_file():
            matched = [str(p)]
        if not matched:
            raise DatasetError(f"{name}={str(p)!r} matches no file. Check the path or glob.")
        paths.extend(m for m in matched if not Path(m).is_dir())
    if not paths:
        raise DatasetError(f"{name}={pattern!r} matches only directories; give files or a glob")
    suffixes = sorted({Path(p).suffix.lower() for p in paths})
    for suffix in suffixes:
        if suffix not in FILE_FORMATS:
            bad = next(p for p in paths if Path(p).suffix.lower() == suffix)
            raise DatasetError(
                f"{name}: cannot read {bad} (suffix {suffix!r}); supported formats: "
                f"{', '.join(FILE_FORMATS)}. Rename or convert the file."
            )
    builders = {FILE_FORMATS[s] for s in suffixes}
    if len(builders) > 1:
        raise DatasetError(
            f"{name}: the files mix formats {suffixes}; pass files of one format at a time"
        )
    for path in paths:
        try:
            with open(path, "rb") as handle:
                handle.read(1)
        except OSError as exc:
            raise DatasetError(
                f"{name}: cannot read file {path}: {exc}. Fix its permissions."
            ) from exc
    return paths


# The columns the tasks read as text. A CSV reader infers each column's type from its cells:
# replies such as "4" or "007" would become the numbers 4 and 7, so these stay strings.
TEXT_COLUMNS = ("text", "prompt", "completion", "chosen", "rejected")


def _load(builder: str, paths: list[str], streaming: bool) -> Any:
    import datasets

    options: dict[str, Any] = {}
    if builder == "csv":
        options["converters"] = dict.fromkeys(TEXT_COLUMNS, str)
    with quiet_datasets():
        return datasets.load_dataset(
            builder, data_files=paths, split="train", streaming=streaming, **options
        )


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """No `datasets` progress bars ("Generating train split") or info logs while jaxtrain
    reads files: jaxtrain's own output (progress_bar) decides what the user sees. The
    user's own settings are restored afterwards; errors still raise."""
    from datasets.utils import logging as ds_logging

    bars, verbosity = ds_logging.is_progress_bar_enabled(), ds_logging.get_verbosity()
    ds_logging.disable_progress_bar()
    ds_logging.set_verbosity(ds_logging.ERROR)
    try:
        yield
    finally:
        ds_logging.set_verbosity(verbosity)
        if bars:
            ds_logging.enable_progress_bar()


def load_files(
    pattern: str | Path | Sequence[str | Path], *, name: str, streaming: bool = False
) -> Any:
    """A ``datasets.Dataset`` (or ``IterableDataset`` with ``streaming``) of the files' rows;
    for small .jsonl/.txt files an ``ArrowRows`` of the same rows."""
    paths = resolve_files(pattern, name=name)
    builder = FILE_FORMATS[Path(paths[0]).suffix.lower()]
    if builder in TEXT_BUILDERS:  # a byte that is not UTF-8, named by file and line
        check_utf8(paths, name)
    if not streaming:
        rows = read_small_files(builder, paths)
        if rows is not None:
            return rows
    if streaming:
        # Parse errors would surface late: read the first row of every shard now.
        for path in paths:
            _first_row(builder, path, name)
        return _load(builder, paths, streaming=True)
    try:
        return _load(builder, paths, streaming=False)
    except Exception as exc:
        for path in paths:  # name the culprit
            _first_row(builder, path, name, full=True)
        raise DatasetError(f"{name}: reading {len(paths)} {builder} file(s) failed: {exc}") from exc


def _first_row(builder: str, path: str, name: str, full: bool = False) -> None:
    try:
        ds = _load(builder, [path], streaming=not full)
        if not full:
            next(iter(ds), None)
    except Exception as exc:
        if builder in TEXT_BUILDERS:  # a large file's encoding, checked now that it failed
            check_utf8([path], name, limit=None)
        if os.path.getsize(path) == 0:
            raise DatasetError(f"{name}: {path} is empty; give it rows or remove it.") from exc
        if path.lower().endswith(".jsonl") and (bad := _bad_json_line(path)):
            raise DatasetError(f"{name}: {path} {bad}. Fix or remove that line.") from exc
        raise DatasetError(
            f"{name}: cannot read file {path} as {builder}: {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}. Fix or remove that file."
        ) from exc


def _bad_json_line(path: str) -> str | None:
    """ "line N is not a JSON object (...)" for the first such line of a .jsonl file: what the
    reader's own error leaves out (it logs the row and raises a generic error)."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.strip())
            except json.JSONDecodeError as err:
                return f"line {number} is not valid JSON ({err.msg}, column {err.colno})"
            if not isinstance(row, dict):
                return f"line {number} is a JSON {type(row).__name__}, not an object of columns"
    return None
