"""Argument errors arrive before any heavy import, as one line naming the field, file or line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxtrain.cli import main

ROOT = Path(__file__).parents[1]

PROBE = """
import sys
from jaxtrain.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("jax", "flax", "optax", "datasets", "transformers") if m in sys.modules)
print(code, heavy)
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--learning_rate", "-1"],
        ["train", "--learning_rate", "abc"],
        ["train", "--use_wandb", "true"],
        ["train", "--task", "dpo", "--beta", "-1"],
        ["train", "--task", "reward", "--beta", "0.1"],
        ["train", "--data.vocab_size", "256"],  # issue 41: was a traceback after JAX started
        ["train", "--sample.top_p", "2"],  # was a traceback after training
        ["train", "--task", "grpo"],  # was "pass dataset_eval=None" after loading the data
    ],
)
def test_argument_errors_arrive_without_importing_jax(tmp_path, argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.stdout.strip() == "2 []", (result.stdout, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_yaml_type_error_names_the_file(tmp_path, capsys):
    config = tmp_path / "mine.yaml"
    config.write_text("learning_rate: fast\nmodel: {hidden_size: big}\n")
    assert main(["train", str(config)]) == 2
    assert f"learning_rate in {config} must be float, got 'fast'" in capsys.readouterr().err
    config.write_text("model: {hidden_size: big}\n")
    assert main(["train", str(config)]) == 2
    assert f"model.hidden_size in {config} must be int" in capsys.readouterr().err


def test_a_tab_in_yaml_is_one_line_naming_file_and_line(tmp_path, capsys):
    config = tmp_path / "tabbed.yaml"
    config.write_text("learning_rate: 1e-3\nmodel:\n\thidden_size: 64\n")
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{config}, line 3" in err and "tab" in err


def test_a_flag_without_a_value_suggests_a_value_of_its_type(capsys):
    assert main(["train", "--max_steps"]) == 2
    assert "--max_steps needs a value, e.g. --max_steps 100." in capsys.readouterr().err
    assert main(["train", "--learning_rate"]) == 2
    assert "e.g. --learning_rate 1e-3" in capsys.readouterr().err
    # Not last on the line: the next flag once became its value ("Config file 0 does not
    # exist", "one positional argument expected").
    assert main(["train", "--max_steps", "--warmup_steps", "0"]) == 2
    assert "--max_steps needs a value, e.g. --max_steps 100." in capsys.readouterr().err
    assert main(["train", "pairs.yaml", "--beta", "--output_dir", "runs/x"]) == 2
    assert "--beta needs a value" in capsys.readouterr().err


def test_a_misspelled_command_suggests_the_command(capsys):
    assert main(["trian"]) == 2
    assert "Did you mean `jaxtrain train`?" in capsys.readouterr().err


def test_exports_are_git_ignored():
    result = subprocess.run(
        ["git", "check-ignore", "-q", "exports/demo/model.safetensors"], cwd=ROOT
    )
    assert result.returncode == 0


def test_a_missing_local_path_is_not_called_a_hub_id(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "data").mkdir()
    assert main(["train", "--model.pretrained", "models/Missing", "--max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "models/Missing: no such directory" in err and "Hub id" not in err
    argv = ["train", "--data.source", "files", "--data.train_files", "data/x.jsonl"]
    assert main([*argv, "--data.tokenizer", "data/tok", "--warmup_steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "data.tokenizer='data/tok': no such directory" in err and "Hub" not in err


@pytest.mark.parametrize("command", ["eval", "sample", "export"])
def test_a_python_run_directory_says_how_to_use_it(tmp_path, capsys, command):
    """A Trainer run from Python (arguments.json, no config.yaml) was only 'not a run
    directory written by jaxtrain train', with no way forward."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "arguments.json").write_text("{}")
    argv = [command, str(tmp_path / "run")] + ([str(tmp_path / "out")] * (command == "export"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is a run started from Python" in err and "trainer.save_pretrained(state, DIR)" in err


def test_a_plan_with_every_device_for_rollouts_is_refused_before_compiling(tmp_path, capsys):
    """It compiled, then showed "cannot run" in the table and exited 0."""
    argv = ["plan", "--task", "grpo", "--devices", "2", "--rollout_devices", "2"]
    assert main([*argv, "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rollout_devices=2 leaves no device to train on" in err


@pytest.mark.parametrize("where", ["nodir", "empty", "rows.jsonl"])
def test_a_data_tokenizer_that_is_no_tokenizer_is_one_line(tmp_path, capsys, monkeypatch, where):
    """A missing, empty or non-tokenizer path was a transformers traceback and exit 1."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    argv = ["train", "--data.source", "files", "--data.train_files", "rows.jsonl",
            "--data.tokenizer", where, "--max_steps", "1", "--warmup_steps", "0"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"data.tokenizer={where!r}" in err and "Traceback" not in err


def test_a_processor_that_does_not_load_is_named_with_its_whole_first_sentence(tmp_path, capsys):
    """A model directory's processor that transformers cannot build (here an image processor
    class it does not know; in the field, one that needs torchvision) was cut mid-word and
    blamed data.tokenizer, which the user had not set (it follows model.pretrained)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "preprocessor_config.json").write_text(
        '{"image_processor_type": "NoSuchImageProcessor", "processor_class": "NoSuchProcessor"}'
    )
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    argv = ["train", "--data.source", "files", "--data.train_files", str(tmp_path / "rows.jsonl"),
            "--data.tokenizer", str(tmp_path / "model"), "--max_steps", "1", "--warmup_steps", "0"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "model.pretrained's unless set" in err and len(err.splitlines()) == 1
    assert "Unrecognized processing class" in err
    # transformers' long reasons keep their whole first sentence(s), never half a word.
    from jaxtrain.errors import first_sentences

    torchvision = (
        "Qwen2VLImageProcessor requires the Torchvision library but it was not found in your "
        "environment. Check out the instructions on the installation page: "
        "https://pytorch.org/get-started/locally/ and follow the ones that match your "
        "environment. Please note that you may need to restart your runtime after installation."
    )
    assert first_sentences(torchvision) == torchvision.split(" Please")[0]
    assert first_sentences("x" * 300) == "x" * 240 + "..."
