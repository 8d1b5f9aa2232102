"""Checkpoints read back through the library: checksums, damaged metadata, another model."""

import json
import shutil

import pytest
from tiny_run import tiny_model, tiny_trainer

from jaxtrain.checkpointing import CheckpointError, committed_steps
from jaxtrain.checkpointing.checksums import verify_checksums


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("integrity") / "run"
    tiny_trainer(str(run), max_steps=4, save_steps=2).train()
    assert committed_steps(run / "checkpoints") == [2, 4]
    return run


@pytest.fixture
def run_copy(saved_run, tmp_path):
    return shutil.copytree(saved_run, tmp_path / "run")


def test_every_committed_file_has_a_checksum_that_matches(saved_run):
    step_dir = saved_run / "checkpoints" / "4"
    recorded = json.loads((step_dir / "checksums.json").read_text())["files"]
    on_disk = {
        str(p.relative_to(step_dir))
        for folder in ("state", "meta")
        for p in (step_dir / folder).rglob("*")
        if p.is_file()
    }
    assert set(recorded) == on_disk and any(name.startswith("state/") for name in recorded)
    assert verify_checksums(step_dir) is True


def test_load_checkpoint_refuses_a_flipped_byte_naming_the_file(run_copy):
    step_dir = run_copy / "checkpoints" / "4"
    array_file = max((step_dir / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    data = bytearray(array_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    array_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=array_file.name) as err:
        tiny_trainer(str(run_copy / "other"), max_steps=4).load_checkpoint(step_dir)
    assert str(run_copy / "checkpoints" / "2") in str(err.value)


def test_empty_metadata_without_checksums_names_the_file_and_the_previous_step(run_copy):
    step_dir = run_copy / "checkpoints" / "4"
    (step_dir / "checksums.json").unlink(
        missing_ok=True
    )  # a checkpoint written before checksums existed
    (step_dir / "meta" / "metadata").write_text("")
    with pytest.raises(CheckpointError, match="meta/metadata") as err:
        tiny_trainer(str(run_copy), max_steps=6).train()
    assert str(run_copy / "checkpoints" / "2") in str(err.value)
    assert "JSONDecodeError" in str(err.value)


def test_load_checkpoint_of_another_model_says_what_differs(saved_run, tmp_path):
    trainer = tiny_trainer(str(tmp_path / "other"), model=tiny_model(hidden_size=48))
    with pytest.raises(CheckpointError, match=r"model\.hidden_size: checkpoint 32, now 48") as err:
        trainer.load_checkpoint(saved_run)
    assert "partial_restore" not in str(err.value)
    # Loading is not resuming: the way forward is the writer's model, not resume flags.
    assert str(err.value).startswith("Cannot load ") and "resume_if_possible" not in str(err.value)


def test_load_checkpoint_with_another_optimizer_names_the_one_to_set(saved_run, tmp_path):
    trainer = tiny_trainer(str(tmp_path / "other"), optimizer="lion")
    with pytest.raises(CheckpointError, match="Set optimizer='adamw' to load it"):
        trainer.load_checkpoint(saved_run)
