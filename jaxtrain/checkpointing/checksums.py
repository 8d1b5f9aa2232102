"""Checksums of every file a checkpoint commits, verified before a restore.

Orbax commits a step directory by renaming it from `<step>.orbax-checkpoint-tmp-*` once its
files are finalized. `checksums.json` is written into the temporary directory just before
that rename (Orbax's post-finalization callback, in its background thread), so it is part of
the commit: a committed step directory either has it complete or predates this feature.
Bytes flipped later (a bad disk, a bad copy) are found before training instead of as a NaN
loss three steps after a "resumed" line.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

from jaxtrain.checkpointing.files import damaged

CHECKSUMS_FILE = "checksums.json"
# The folders whose files the checksums cover (Orbax's own step metadata is rewritten at
# commit time, so it is not covered).
COVERED = ("state", "meta", "extra")
_CHUNK = 8 << 20  # crc32 releases the GIL on large buffers: the loop keeps running


def file_crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _covered_files(step_dir: Path) -> list[Path]:
    return sorted(p for folder in COVERED for p in (step_dir / folder).rglob("*") if p.is_file())


def write_checksums(step_dir: Path) -> None:
    """Record size and crc32 of every file under `step_dir`'s state, meta and extra folders."""
    files = {
        str(p.relative_to(step_dir)): [p.stat().st_size, file_crc32(p)]
        for p in _covered_files(step_dir)
    }
    tmp = step_dir / (CHECKSUMS_FILE + ".tmp")
    tmp.write_text(json.dumps({"algorithm": "crc32", "files": files}))
    tmp.replace(step_dir / CHECKSUMS_FILE)


def verify_checksums(step_dir: Path) -> bool:
    """Raise CheckpointError naming the first file whose bytes differ from what was
    committed (or that is missing); False when the checkpoint has no checksums (written
    before jaxtrain recorded them), True when every file matches."""
    step_dir = Path(step_dir)
    record = step_dir / CHECKSUMS_FILE
    if not record.is_file():
        return False
    try:
        files = json.loads(record.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise damaged(step_dir, record, f"its checksum record is unreadable ({err})") from err
    for name, (size, crc) in files.items():
        path = step_dir / name
        if not path.is_file():
            raise damaged(step_dir, path, "the file is missing")
        if path.stat().st_size != size:
            raise damaged(step_dir, path, f"{path.stat().st_size} bytes, {size} were committed")
        if file_crc32(path) != crc:
            raise damaged(step_dir, path, "its bytes differ from what was committed (crc32)")
    return True
