"""What a user of `jaxtrain train` sees when a checkpoint is damaged or a run is rerun:
real processes against one small run directory, each case on its own copy."""

import json
import shutil

import pytest
from test_cli import TINY, jaxtrain

from jaxtrain.observability.logs import read_jsonl

ARGS = [*TINY, "--max_steps", "4", "--save_steps", "2", "--eval_steps", "2"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("cli_checkpoints") / "run"
    result = jaxtrain("train", "--output_dir", str(run), *ARGS)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


@pytest.fixture
def run_copy(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def rerun(run):
    return jaxtrain("train", "--output_dir", str(run), *ARGS)


def assert_refused_cleanly(result, *words):
    """Exit 2, one clear message naming `words`, no traceback, nothing trained."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "Event loop is closed" not in result.stderr
    assert "resumed from" not in result.stdout and "compiled" not in result.stdout
    for word in words:
        assert word in result.stderr, result.stderr[-3000:]


def biggest_array_file(step_dir):
    return max((step_dir / "state").rglob("d/*"), key=lambda p: p.stat().st_size)


def test_flipped_bytes_in_an_array_file_are_refused_naming_the_file(run_copy):
    array_file = biggest_array_file(run_copy / "checkpoints" / "4")
    data = bytearray(array_file.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    array_file.write_bytes(bytes(data))
    result = rerun(run_copy)
    assert_refused_cleanly(result, array_file.name, "damaged", str(run_copy / "checkpoints" / "2"))


def test_an_empty_metadata_file_is_refused_offering_the_previous_checkpoint(run_copy):
    (run_copy / "checkpoints" / "4" / "meta" / "metadata").write_text("")
    result = rerun(run_copy)
    assert_refused_cleanly(result, "meta/metadata", str(run_copy / "checkpoints" / "2"))


def test_a_deleted_manifest_is_refused_with_exit_2(run_copy):
    step_dir = run_copy / "checkpoints" / "4"
    (step_dir / "state" / "manifest.ocdbt").unlink()
    # Without checksums, as a checkpoint of an older jaxtrain: Orbax itself finds the damage.
    (step_dir / "checksums.json").unlink(missing_ok=True)
    result = rerun(run_copy)
    assert_refused_cleanly(result, f"Could not restore the train state from {step_dir}")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]


def test_rerunning_a_finished_run_adds_no_second_eval_record(run_copy):
    result = rerun(run_copy)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_jsonl(run_copy / "metrics.jsonl")
    evals = [r["step"] for r in records if "eval/loss" in r]
    logged = [r["step"] for r in records if "loss" in r]
    assert evals == [2, 4], json.dumps(records)
    assert logged == sorted(set(logged)), json.dumps(records)


def test_export_into_a_directory_it_cannot_create_is_one_clear_error(finished_run, tmp_path):
    # As root (CI containers) permissions do not stop writes, so the unwritable directory is
    # one whose parent is a file: the same OSError path as a PermissionError.
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    result = jaxtrain("export", str(finished_run), str(blocker / "hf"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"cannot write to {blocker / 'hf'}" in result.stderr
