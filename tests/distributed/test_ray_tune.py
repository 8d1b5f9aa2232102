"""Ray Tune over real jaxtrain runs: ASHA stops bad trials, the best config trains again."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pytest
import yaml

ray = pytest.importorskip("ray")

from jaxtrain.arguments import ArgumentError  # noqa: E402
from jaxtrain.cli.tune import parse_search  # noqa: E402

VOCAB, SEQ = 32, 16


@pytest.fixture(scope="module")
def ray_session():
    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp = tempfile.mkdtemp(prefix="jtune", dir="/tmp")  # short: Ray puts sockets there
    ray.init(include_dashboard=False, num_cpus=2, _temp_dir=temp, log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def write_rows(path, n: int, seed: int) -> str:
    """Counting sequences (t, t+1, ...) mod VOCAB: a good learning rate learns them in steps."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for start in rng.integers(0, VOCAB, size=n):
            f.write(
                json.dumps({"input_ids": [(int(start) + i) % VOCAB for i in range(SEQ)]}) + "\n"
            )
    return str(path)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    config = {
        "max_steps": 4,
        "eval_steps": 1,
        "logging_steps": 1,
        "total_batch_size": 8,
        "max_sequence_length": SEQ,
        "warmup_steps": 0,
        "scheduler": "constant",
        "max_eval_batches": 2,
        "progress_bar": "none",
        "run_report": False,
        "model": {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 64,
        },
        "data": {
            "source": "files",
            "train_files": write_rows(tmp / "train.jsonl", 64, 0),
            "eval_files": write_rows(tmp / "eval.jsonl", 16, 1),
        },
    }
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_search_specs_parse_and_bad_ones_fail_early():
    spec = parse_search("lr=loguniform(1e-4,1e-2)")
    assert (spec.key, spec.space, spec.values) == ("learning_rate", "loguniform", (1e-4, 1e-2))
    assert parse_search("model.hidden_size=choice(32,64)").values == (32, 64)
    with pytest.raises(ArgumentError, match="expected KEY=SPACE"):
        parse_search("lr:loguniform(1,2)")
    with pytest.raises(ArgumentError, match="loguniform takes 2 values, got 1"):
        parse_search("lr=loguniform(1e-4)")
    with pytest.raises(ArgumentError, match="'learning_rat' is not a TrainingArguments field"):
        parse_search("learning_rat=uniform(0,1)")


def test_asha_stops_bad_trials_early_and_the_best_yaml_trains(
    ray_session, config_file, tmp_path, capsys
):
    from jaxtrain.cli import main

    tune_dir = tmp_path / "tune"
    # One trial at a time, the good learning rate first: ASHA has a result to compare the
    # worse ones against at its first rung.
    command = ["tune", str(config_file), "--search", "lr=grid(0.03,0.00001,0.00002,0.00003)"]
    command += ["--scheduler", "asha", "--max_concurrent_trials", "1", "--tune_dir", str(tune_dir)]
    assert main(command) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "evaluations" in line]
    assert len(lines) == 4 and any("4/4 evaluations" in line for line in lines)
    assert any("(stopped early)" in line for line in lines)  # ASHA stopped a bad trial
    best = yaml.safe_load((tune_dir / "best.yaml").read_text())
    assert best["learning_rate"] == 0.03 and best["output_dir"] == str(tune_dir / "best")
    assert main(["train", str(tune_dir / "best.yaml"), "--max_steps", "1"]) == 0
    assert (tune_dir / "best" / "checkpoints" / "1").is_dir()
