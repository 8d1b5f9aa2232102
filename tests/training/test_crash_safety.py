"""kill -9 at random moments, including mid-save: every restart resumes from the newest
committed checkpoint, no committed checkpoint is unreadable, and the end result equals an
uninterrupted run bit for bit."""

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import tiny_run

from jaxtrain.checkpointing import committed_steps, read_metadata

WORKER = Path(tiny_run.__file__)
STEPS = 24


def start(output_dir: Path) -> subprocess.Popen:
    # Every step is saved, the newest 3 kept: most of the time a write is in flight.
    command = [sys.executable, str(WORKER), str(output_dir), str(STEPS)]
    command += ["--save_steps", "1", "--save_total_limit", "3"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def wait_for(condition, process: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"worker exited early: {process.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the worker")
        time.sleep(0.005)


def saving_now(root: Path) -> bool:
    return root.is_dir() and any("tmp" in p.name for p in root.iterdir())


def restorer():
    """A Trainer with the worker's model and optimizer, used only to read checkpoints."""
    arguments = tiny_run.tiny_arguments("/nonexistent", max_steps=STEPS)
    from jaxtrain import Trainer

    return Trainer(
        arguments=arguments,
        model=tiny_run.tiny_model(hidden_size=128, vocab_size=4096),
        dataset_train=tiny_run.token_dataset(),
    )


def test_kill_9_at_random_moments_never_loses_or_corrupts_work(tmp_path):
    rng = random.Random(7)
    run, root = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    reader = restorer()
    newest = 0
    for attempt in range(4):
        process = start(run)

        def progressed(newest=newest):
            return committed_steps(root)[-1:] > [newest]

        if attempt % 2 == 0:  # in the middle of a checkpoint write
            wait_for(lambda: saving_now(root) and progressed(), process)
        else:  # anywhere, a little after progress was made
            wait_for(progressed, process)
            time.sleep(rng.uniform(0.0, 0.3))
        process.kill()
        process.wait()
        steps = committed_steps(root)
        assert steps and steps[-1] > newest, "each restart resumed and made progress"
        newest = steps[-1]
        for step in steps:  # everything that looks committed is readable
            assert read_metadata(root / str(step))["step"] == step
            reader.load_checkpoint(root / str(step))

    final = start(run)
    assert final.wait(timeout=300) == 0, final.stderr.read()[-3000:]
    reference = start(tmp_path / "straight")
    assert reference.wait(timeout=300) == 0, reference.stderr.read()[-3000:]

    resumed = reader.load_checkpoint(run)
    expected = reader.load_checkpoint(tmp_path / "straight")
    assert int(resumed.step) == int(expected.step) == STEPS
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not any("tmp" in p.name for p in root.iterdir())
