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
import errno
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from jaxtrain.checkpointing.files import CheckpointError

LOCK_NAME = ".jaxtrain.lock"
# flock's errors on a file system that has no locks (not "held by another process").
UNSUPPORTED = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)
logger = logging.getLogger("jaxtrain.checkpointing")


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
        except OSError as err:
            if err.errno not in UNSUPPORTED:
                raise
            # Some cluster file systems (Lustre mounted without flock) have no locks: the run
            # goes on unguarded, and says so.
            logger.warning(
                "output_dir %s is on a file system without file locks (%s): a second run "
                "started into it would not be refused.",
                output_dir,
                err.strerror,
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
