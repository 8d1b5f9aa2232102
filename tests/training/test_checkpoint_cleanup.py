"""A failed save's partial directories are gone when the run ends, even when a write of that
save still running recreates one after it was first removed (Orbax's commit thread stops at
the first failed write; the others go on), and when closing Orbax raises that save's error
once more."""

import errno
import threading
import time

import pytest

from jaxtrain.checkpointing.run import _Saver
from jaxtrain.errors import CheckpointError

PARTIAL = "7.orbax-checkpoint-tmp"


def late_writer(root, first_removed: threading.Event, delay_s: float, times: int):
    """A write still in flight: once the directory is gone, it makes it again `times` times."""

    def write():
        for attempt in range(times):
            while (root / PARTIAL).exists():
                time.sleep(0.01)
            first_removed.set()
            time.sleep(delay_s)
            (root / PARTIAL / "state").mkdir(parents=True, exist_ok=True)
            (root / PARTIAL / "state" / f"chunk{attempt}").write_bytes(b"partial")

    return threading.Thread(target=write, daemon=True)


def test_a_directory_recreated_by_a_late_write_is_removed_too(tmp_path):
    saver = _Saver(tmp_path)
    (tmp_path / PARTIAL / "state").mkdir(parents=True)
    removed = threading.Event()
    writer = late_writer(tmp_path, removed, delay_s=0.3, times=2)
    writer.start()
    saver._remove_uncommitted(patience_s=10.0)
    writer.join(timeout=5)
    assert removed.is_set() and not writer.is_alive()  # the late write did happen
    assert not list(tmp_path.glob("*.orbax-checkpoint-tmp*"))
    saver._manager.close()


class ClosingRaisesAgain:
    """Orbax's manager after a failed async save, as a loaded machine showed it: its close
    raises the save's error a second time (the async checkpointer, not the finalize thread,
    still held it)."""

    def __init__(self, manager):
        self.manager = manager

    def close(self):
        self.manager.close()
        raise OSError(errno.ENOSPC, "No space left on device")


def test_the_removal_still_waits_for_late_writes_when_closing_orbax_raises(tmp_path):
    saver = _Saver(tmp_path)
    (tmp_path / PARTIAL / "state").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="the disk is full"), saver._failures():
        raise OSError(errno.ENOSPC, "No space left on device")  # a save that failed
    assert not (tmp_path / PARTIAL).exists()
    removed = threading.Event()
    writer = late_writer(tmp_path, removed, delay_s=0.3, times=1)
    saver._manager = ClosingRaisesAgain(saver._manager)
    writer.start()
    with pytest.raises(CheckpointError, match="the disk is full"):
        saver.close()
    writer.join(timeout=5)
    assert removed.is_set() and not writer.is_alive()  # the late write did happen
    assert not list(tmp_path.glob("*.orbax-checkpoint-tmp*"))
