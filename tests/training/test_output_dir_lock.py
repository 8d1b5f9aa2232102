"""A second run into an output_dir another run is writing is refused, naming the holder; the
directory is free again the moment that run ends, even by kill -9."""

import errno
import fcntl
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tiny_run

from jaxtrain.checkpointing import CheckpointError, committed_steps, hold_output_dir

WORKER = Path(tiny_run.__file__)


def test_a_second_run_is_refused_while_the_first_writes_and_not_after_a_kill(tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, str(WORKER), str(run), "100000", "--save_steps", "1"]
    worker = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        deadline = time.monotonic() + 180
        while not committed_steps(run / "checkpoints"):  # it is training and saving
            assert worker.poll() is None, worker.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "the worker made no checkpoint"
            time.sleep(0.05)
        second = tiny_run.tiny_trainer(str(run), max_steps=2, resume_if_possible=True)
        with pytest.raises(CheckpointError, match=f"in use by another run \\(pid {worker.pid} "):
            second.train()
        assert worker.poll() is None  # the refused run touched nothing of the first
    finally:
        worker.kill()
        worker.wait()
    steps = committed_steps(run / "checkpoints")
    # Free after a kill -9: the same trainer resumes the killed run's newest checkpoint.
    third = tiny_run.tiny_trainer(
        str(run),
        model=tiny_run.tiny_model(hidden_size=128, vocab_size=4096),
        max_steps=steps[-1] + 1,
        resume_if_possible=True,
    )
    output = third.train()
    assert int(output.state.step) == steps[-1] + 1


def test_a_file_system_without_locks_warns_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    """Lustre mounted without flock answers ENOSYS: the run is not refused for it, and the log
    says a second run into the directory would not be."""

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    entered = False
    level = caplog.at_level(logging.WARNING, logger="jaxtrain.checkpointing")
    with level, hold_output_dir(tmp_path / "run"):
        entered = True
    assert entered
    assert "without file locks (Function not implemented)" in caplog.text
