"""A run trained on a 4-device mesh, exported, sampled and evaluated by a process with one
device (this one): the run-directory commands restore onto the devices present."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from common import worker_env

from jaxtrain.cli import main
from jaxtrain.observability.logs import read_jsonl
from jaxtrain.parallel.mesh import ALL_ON_FSDP, describe_restore, restore_axis_dims

TRAIN = [
    "--sharding_axis_dims", "2,1,1,2,1", "--max_steps", "2", "--warmup_steps", "0",
    "--total_batch_size", "4", "--max_sequence_length", "32", "--logging_steps", "1",
    "--eval_steps", "2", "--max_eval_batches", "1", "--data.max_train_bytes", "200000",
    "--data.vocab_size", "384", "--model.hidden_size", "32", "--model.intermediate_size", "64",
    "--model.num_hidden_layers", "1", "--model.num_attention_heads", "2",
    "--model.num_key_value_heads", "2", "--sample.max_new_tokens", "0", "--progress_bar", "none",
]  # fmt: skip
NOTE = "the run trained on a 2x1x1x2x1 mesh of 4 devices; restoring onto 1 device"


@pytest.fixture(scope="module")
def four_device_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("remesh") / "run"
    env = {
        **worker_env(),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
    }
    command = [sys.executable, "-m", "jaxtrain.cli", "train", "--output_dir", str(run), *TRAIN]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_export_sample_and_eval_of_a_4_device_run_on_1_device(four_device_run, tmp_path, capsys):
    assert jax.device_count() == 1  # this process: the user's smaller machine
    run = four_device_run
    # eval reproduces the loss the 4-device run logged for the same checkpoint.
    assert main(["eval", str(run)]) == 0
    out, err = capsys.readouterr()
    assert NOTE in err, err
    printed = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    logged = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/loss" in r][-1]
    assert abs(float(printed["eval/loss"]) - logged["eval/loss"]) < 1e-4

    assert main(["sample", str(run), "--prompt", "import ", "--max_new_tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert "--- sample" in out and NOTE in err

    assert main(["export", str(run), str(tmp_path / "hf")]) == 0
    assert NOTE in capsys.readouterr().err
    from jaxtrain.cli.run_dir import restore_run
    from jaxtrain.hf import AutoModelForCausalLM

    restored = restore_run(run).model()  # equal to the checkpoint: eval above says so
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = jax.numpy.array([[5, 17, 42, 99, 7, 3]])
    np.testing.assert_allclose(exported(ids), restored(ids), rtol=1e-5, atol=1e-5)


def test_an_explicit_mesh_is_taken_and_one_that_does_not_fit_is_refused(
    four_device_run, tmp_path, capsys
):
    run = str(four_device_run)
    args = ["sample", run, "--sharding_axis_dims", "1,-1,1,1,1", "--max_new_tokens", "2"]
    assert main(args) == 0
    assert "restoring onto" not in capsys.readouterr().err  # the user chose it: no note
    assert main(["export", run, str(tmp_path / "hf"), "--sharding_axis_dims", "2,1,1,1,1"]) == 2
    err = capsys.readouterr().err
    assert "sharding_axis_dims=(2, 1, 1, 1, 1)" in err and "1 are available" in err, err
    assert not (tmp_path / "hf" / "config.json").exists()


def test_the_restore_mesh_keeps_the_runs_where_it_fits_else_fsdp_else_one_device():
    # The run's own mesh where it fits, -1 resolved here.
    assert restore_axis_dims((1, -1, 1, 1, 1), 2, trained_devices=8) == ((1, -1, 1, 1, 1), 2)
    assert restore_axis_dims((2, 1, 1, 2, 1), 4, trained_devices=4) == ((2, 1, 1, 2, 1), 4)
    # More devices than trained it: the run's mesh on as many as it had.
    assert restore_axis_dims((2, 1, 1, 2, 1), 8, trained_devices=4) == ((2, 1, 1, 2, 1), 4)
    # ep=-1 trained as ep=4 (over 4 experts): 8 devices would make it ep=8, 2 devices ep=2.
    assert restore_axis_dims((1, 1, -1, 1, 1), 8, trained_devices=4) == ((1, 1, 4, 1, 1), 4)
    assert restore_axis_dims((1, 1, -1, 1, 1), 2, trained_devices=4) == ((1, 2, 1, 1, 1), 2)
    assert restore_axis_dims((1, 1, -1, 1, 1), 8) == ((1, 1, -1, 1, 1), 8)  # not recorded
    # Too few devices: all on fsdp (it shards only dimensions it divides) ...
    assert restore_axis_dims((2, 1, 1, 2, 1), 2, trained_devices=4) == ((1, 2, 1, 1, 1), 2)
    # ... unless an eval batch of 4 rows does not split over them: one device.
    assert restore_axis_dims((1, -1, 1, 1, 2), 3, trained_devices=4, rows=4) == (
        (1, 1, 1, 1, 1),
        1,
    )
    assert restore_axis_dims((1, -1, 1, 1, 2), 6, trained_devices=4, rows=6, seq_len=32) == (
        (1, -1, 1, 1, 2),
        6,
    )
    # Several processes cannot shrink to one device or a part: fsdp over all of them.
    assert restore_axis_dims((4, 1, 1, 1, 1), 6, rows=4, processes=2) == ((1, 6, 1, 1, 1), 6)
    note = describe_restore((2, 1, 1, 2, 1), None, (1, 2, 1, 1, 1), 2, 2)
    assert note == (
        "the run trained on a 2x1x1x2x1 mesh of 4 devices; restoring onto 2 devices on fsdp "
        "(1x2x1x1x1)"
    )
    note = describe_restore((1, 1, -1, 1, 1), 4, (1, 1, 4, 1, 1), 4, 8)
    assert note.endswith("1x1x4x1x1 mesh of 4 devices; restoring onto 4 of the 8 devices here, "
                         "as 1x1x4x1x1"), note  # fmt: skip
    assert ALL_ON_FSDP == (1, -1, 1, 1, 1)
