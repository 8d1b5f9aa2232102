"""One run writes into an output_dir at a time.

Two runs in one directory commit into the same step directories (`<step>.orbax-checkpoint-tmp`
is the same name for both), so each can delete or rename what the other is writing, and
keep-N of one deletes the other's checkpoints. The run's first process therefore holds an
advisory lock on `<output_dir>/.jaxtrain.lock` (`flock`: the kernel drops it when the
process ends, even by kill -9, so a crashed run never leaves the directory locked).
The other processes of a multi-host run share the directory and take no lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from jaxtrain.checkpointing.files import CheckpointError

LOCK_NAME = ".jaxtrain.lock"


@contextlib.contextmanager
def hold_output_dir(output_dir: str | Path, *, take: bool = True) -> Iterator[None]:
    """Hold `output_dir` for the duration of the block, or raise a CheckpointError naming
    the run that holds it. `take=False` (a multi-host run's other processes) holds nothing."""
    if not take:
        yield
        return
    path = Path(output_dir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise CheckpointError(
                f"output_dir {output_dir} is in use by another run ({holder}): two runs in one "
                "directory overwrite each other's checkpoints. Wait for that run to end, or "
                "choose another output_dir."
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
