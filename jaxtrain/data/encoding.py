"""Text files that are not UTF-8, found before they are read.

pyarrow and `datasets` read .jsonl, .txt and .csv as UTF-8; a stray Latin-1 byte surfaced as
a UnicodeDecodeError traceback deep in pyarrow (or `datasets`' "An error occurred while
generating the dataset"), naming no file or line. Files up to CHECKED_BYTES in all are
decoded here first, in C-speed chunks (a few hundred MB/s), and the first bad byte is named
by file, line and column; larger corpora are checked only when reading them fails.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path

from jaxtrain.data.errors import DatasetError

__all__ = ["CHECKED_BYTES", "check_utf8"]

CHECKED_BYTES = 1 << 30
_CHUNK = 1 << 20


def check_utf8(paths: Sequence[str], name: str, *, limit: int | None = CHECKED_BYTES) -> None:
    """DatasetError naming the first file, line and column that is not UTF-8 (files over
    `limit` bytes in all are passed over; None: always checked)."""
    if limit is not None and sum(Path(p).stat().st_size for p in paths) > limit:
        return
    for path in paths:
        _check_file(path, name)


def _check_file(path: str, name: str) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    done, lines = 0, 0  # bytes decoded before the chunk, and the newlines in them
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            pending = decoder.getstate()[0]  # a character's first bytes, from the last chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:  # err.start counts from the pending bytes
                data = pending + chunk  # `pending` holds no newline: a character's start
                bad = done - len(pending) + err.start  # the byte's offset in the file
                line = lines + data[: err.start].count(b"\n") + 1
                column = bad - _line_start(path, bad) + 1
                raise DatasetError(
                    f"{name}: {path} line {line}, column {column}: byte 0x{data[err.start]:02x} "
                    "is not UTF-8 text; re-encode the file as UTF-8 (for Latin-1 text: iconv -f "
                    "latin1 -t utf-8) or fix that line."
                ) from None
            if not chunk:
                return
            done += len(chunk)
            lines += chunk.count(b"\n")


def _line_start(path: str, offset: int) -> int:
    """The offset where the line holding byte `offset` begins (read backwards in blocks)."""
    with open(path, "rb") as f:
        end = offset
        while end > 0:
            begin = max(end - (1 << 16), 0)
            f.seek(begin)
            newline = f.read(end - begin).rfind(b"\n")
            if newline >= 0:
                return begin + newline + 1
            end = begin
    return 0
