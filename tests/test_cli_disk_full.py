"""A disk that fills up during a save: `jaxtrain train` in a real process writing into a
real 3 MiB tmpfs (mounting one needs root; elsewhere this test is skipped)."""

import subprocess

import pytest
from test_cli import TINY, jaxtrain

from jaxtrain.checkpointing import committed_steps, read_metadata
from jaxtrain.checkpointing.checksums import verify_checksums


@pytest.fixture
def small_disk(tmp_path):
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 3 MiB tmpfs here (needs root): {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_a_full_disk_names_the_checkpoint_and_keeps_the_committed_ones(small_disk):
    run = small_disk / "run"
    result = jaxtrain(
        "train", *TINY, "--max_steps", "40", "--save_steps", "1",
        "--evaluation_strategy", "no", "--progress_bar", "none", "--output_dir", str(run),
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "Event loop is closed" not in result.stderr, result.stderr[-3000:]
    assert "the disk is full" in result.stderr, result.stderr[-3000:]
    steps = committed_steps(run / "checkpoints")
    assert steps and steps[-1] < 40
    assert f"Could not save checkpoint {run / 'checkpoints' / str(steps[-1] + 1)}" in result.stderr
    assert f"{run / 'checkpoints' / str(steps[-1])}, is intact" in result.stderr
    # Nothing half-written is left beside the committed checkpoints, and those read back.
    leftovers = [p.name for p in (run / "checkpoints").iterdir() if not p.name.isdigit()]
    assert leftovers == [], result.stderr[-3000:]
    for step in steps:
        assert verify_checksums(run / "checkpoints" / str(step))
        assert read_metadata(run / "checkpoints" / str(step))["step"] == step
