"""Ctrl-C at any moment of `jaxtrain train`: during start-up (JAX loading, data, model) it
exits 130 at once with one line; during training a second Ctrl-C (the first asked for a save
and stop) aborts without a traceback. Real processes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_cli import TINY, logged_step, read_until


def start_train(output_dir: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "jaxtrain.cli", "train", *TINY, *extra]
    command += ["--output_dir", str(output_dir), "--progress_bar", "json"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def wait_until_jax_is_loading(process: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until jaxlib's shared library is mapped: JAX is being imported or initialised, and
    nothing has been trained yet."""
    maps, deadline = Path(f"/proc/{process.pid}/maps"), time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-2000:]
        if "jaxlib" in maps.read_text():
            return
        time.sleep(0.01)
    raise AssertionError("jaxlib was never loaded")


def assert_clean_interrupt(process: subprocess.Popen, stdout: str, stderr: str) -> None:
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    assert "SIGINT" in stderr
    assert "done (completed)" not in stdout


def test_ctrl_c_while_jax_starts_exits_130_without_a_traceback(tmp_path):
    process = start_train(tmp_path / "run")
    wait_until_jax_is_loading(process)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=240)
    assert_clean_interrupt(process, stdout, stderr)


def test_a_second_ctrl_c_during_training_aborts_without_a_traceback(tmp_path):
    extra = ("--max_steps", "100000", "--logging_steps", "1", "--evaluation_strategy", "no")
    process = start_train(tmp_path / "run", *extra)
    read_until(process, lambda line: logged_step(line) >= 2)
    process.send_signal(signal.SIGINT)
    time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=240)
    assert_clean_interrupt(process, stdout, stderr)
    assert "second SIGINT" in stderr
