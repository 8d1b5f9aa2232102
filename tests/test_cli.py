"""`jaxtrain train | eval | sample` in real subprocesses, at a tiny size."""

import json
import os
import subprocess
import sys

import yaml

from jaxtrain.training.logs import read_jsonl

TINY = [
    "--max_steps", "8",
    "--total_batch_size", "4",
    "--max_sequence_length", "32",
    "--logging_steps", "4",
    "--eval_steps", "4",
    "--max_eval_batches", "2",
    "--warmup_steps", "2",
    "--data.max_train_bytes", "200000",
    "--data.vocab_size", "384",
    "--model.hidden_size", "32",
    "--model.intermediate_size", "64",
    "--model.num_hidden_layers", "1",
    "--model.num_attention_heads", "2",
    "--model.num_key_value_heads", "1",
    "--sample.max_new_tokens", "8",
]  # fmt: skip


def jaxtrain(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "jaxtrain.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_train_then_eval_and_sample_from_the_run_directory(tmp_path):
    run = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text("learning_rate: 0.1\nprogress_bar: json\nmodel:\n  rms_norm_eps: 1e-5\n")
    result = jaxtrain(
        "train", str(config), "--learning_rate", "3e-3", "--output_dir", str(run), *TINY
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--- sample" in result.stdout and "done (completed):" in result.stdout
    # json progress lines are machine readable
    progress = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert any(p.get("step") == 8 and "loss" in p for p in progress)

    # The resolved configuration is saved: the flag beat the file, sections are complete.
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["learning_rate"] == 3e-3 and saved["max_steps"] == 8
    assert saved["model"]["hidden_size"] == 32 and saved["model"]["rms_norm_eps"] == 1e-5
    assert saved["model"]["vocab_size"] == 384
    assert (run / "checkpoints" / "8").is_dir() and (run / "tokenizer").is_dir()

    # Evaluating the saved checkpoint reproduces the loss the run logged at its end.
    final_eval = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/loss" in r][-1]
    result = jaxtrain("eval", str(run))
    assert result.returncode == 0, result.stderr[-3000:]
    printed = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert abs(float(printed["eval/loss"]) - final_eval["eval/loss"]) < 1e-4

    result = jaxtrain("sample", str(run), "--prompt", "import ", "--max_new_tokens", "5")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--- sample" in result.stdout and "import " in result.stdout


def test_bad_flags_exit_2_with_a_message_naming_the_field(tmp_path):
    result = jaxtrain("train", "--output_dir", str(tmp_path), "--learning_rate", "-1")
    assert result.returncode == 2
    assert "learning_rate" in result.stderr and "Traceback" not in result.stderr
    result = jaxtrain("train", "--output_dir", str(tmp_path), "--optimzer", "adamw")
    assert result.returncode == 2 and "did you mean 'optimizer'" in result.stderr
    result = jaxtrain("train", "--data.source", "hub")
    assert result.returncode == 2 and "data.source" in result.stderr
