"""`jaxtrain train | eval | sample` in real subprocesses, at a tiny size."""

import json
import os
import signal
import subprocess
import sys
import time

import yaml

from jaxtrain.cli.huge_pages import environment_with_huge_pages
from jaxtrain.observability.logs import read_jsonl

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
    # Without GLIBC_TUNABLES: the command adds glibc's huge-page tunable itself (restarting
    # once, jaxtrain/cli/huge_pages.py) and names it in its start-up line.
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | {"JAX_PLATFORMS": "cpu"}
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
    restarted = environment_with_huge_pages({})  # None where the machine cannot use it
    tunable = restarted["GLIBC_TUNABLES"] if restarted else "(unset)"
    assert f"GLIBC_TUNABLES {tunable}" in result.stdout
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

    # `jaxtrain serve` loads the run directory: its newest checkpoint and its tokenizer.
    from jaxtrain.cli.served_model import load_served_model
    from jaxtrain.models import generate
    from jaxtrain.serving import Engine, SamplingParams

    model, tokenizer, name = load_served_model(run)
    ids = tokenizer("import ")["input_ids"]
    engine = Engine(model, tokenizer=tokenizer, max_slots=1, eos_token_ids=[])
    served = engine.generate([ids], SamplingParams(max_tokens=5, temperature=0.0))[0][0]
    assert name == "run" and served.token_ids == generate(model, ids, max_new_tokens=5).tolist()


def test_packing_trains_on_the_embedded_corpus_files_one_segment_each(tmp_path):
    from jaxtrain.cli.run_dir import build_data
    from jaxtrain.data import load_default_corpus

    data = {"source": "default", "vocab_size": 384, "max_train_bytes": 200_000}
    corpus = load_default_corpus(vocab_size=384, max_train_bytes=200_000)
    # Packed, the train split comes as its files, which the Trainer packs with a segment per
    # file (it came as rows cut from the files joined, so --packing true had nothing to
    # pack); the eval rows are the unpacked run's, so the two runs' eval losses compare.
    train, evaluation, tokenizer = build_data(data, 32, packing=True)
    assert train["text"] == corpus.train["text"] and len(tokenizer) == len(corpus.tokenizer)
    rows, unpacked_evaluation, _ = build_data(data, 32)
    assert {len(ids) for ids in rows[:8]["input_ids"]} == {32}
    assert evaluation["input_ids"] == unpacked_evaluation["input_ids"]
    assert len(evaluation) * 32 > 0.9 * sum(
        len(tokenizer(t)["input_ids"]) for t in corpus.eval["text"]
    )
    # A packed run's eval loss is what `jaxtrain eval` of its run directory computes.
    run = tmp_path / "run"
    result = jaxtrain("train", "--packing", "true", "--output_dir", str(run), *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert yaml.safe_load((run / "config.yaml").read_text())["packing"] is True
    final_eval = [r for r in read_jsonl(run / "metrics.jsonl") if "eval/loss" in r][-1]
    result = jaxtrain("eval", str(run))
    assert result.returncode == 0, result.stderr[-3000:]
    printed = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert abs(float(printed["eval/loss"]) - final_eval["eval/loss"]) < 1e-4


def test_bad_flags_exit_2_with_a_message_naming_the_field(tmp_path):
    result = jaxtrain("train", "--output_dir", str(tmp_path), "--learning_rate", "-1")
    assert result.returncode == 2
    assert "learning_rate" in result.stderr and "Traceback" not in result.stderr
    result = jaxtrain("train", "--output_dir", str(tmp_path), "--optimzer", "adamw")
    assert result.returncode == 2 and "did you mean 'optimizer'" in result.stderr
    result = jaxtrain("train", "--data.source", "hub")
    assert result.returncode == 2 and "data.source" in result.stderr


def read_until(process: subprocess.Popen, predicate, timeout: float = 240.0) -> list[str]:
    """Lines of the process's stdout up to and including the first that satisfies predicate."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if predicate(line):
            return lines
    raise AssertionError(f"never saw the expected line; output so far: {lines[-20:]}")


def logged_step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", -1))
    except (json.JSONDecodeError, AttributeError):
        return -1


def test_signals_and_time_limit_stop_after_saving_and_a_rerun_resumes(tmp_path):
    from jaxtrain.checkpointing import committed_steps

    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "jaxtrain.cli", "train", *TINY,
        "--max_steps", "100000", "--output_dir", str(run), "--progress_bar", "json",
        "--logging_steps", "1", "--evaluation_strategy", "no",
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    last = 0
    for signal_number, exit_code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        seen = read_until(process, lambda line, last=last: logged_step(line) >= last + 2)
        process.send_signal(signal_number)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == exit_code, stderr[-2000:]
        assert f"{signal.Signals(signal_number).name} received" in stderr
        if last:
            assert any(f"at step {last}" in line for line in seen)  # it resumed
        steps = committed_steps(run / "checkpoints")
        assert steps[-1] > last, "the stop must save the step it reached"
        last = steps[-1]
    assert (run / "config.yaml").is_file()

    limited = jaxtrain("train", *command[4:], "--training_time_limit", "3s")
    assert limited.returncode == 3, limited.stderr[-2000:]
    assert "training_time_limit=3s reached" in limited.stdout
    assert committed_steps(run / "checkpoints")[-1] > last
