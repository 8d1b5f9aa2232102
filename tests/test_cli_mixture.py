"""`jaxtrain train` on a `data.mixture` of files: the YAML section, its one-line errors, a
run that logs each source, and its run directory rebuilt by `jaxtrain eval`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from jaxtrain.cli import main
from jaxtrain.observability.logs import read_jsonl

MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}  # fmt: skip


def write_sources(tmp_path):
    for name, base in (("web", 3), ("code", 40)):
        rows = [{"input_ids": [base + (i + j) % 20 for j in range(16)]} for i in range(40)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def config(tmp_path, mixture, **fields) -> str:
    values = dict(output_dir=str(tmp_path / "run"), max_steps=4, total_batch_size=8,
                  max_sequence_length=16, logging_steps=2, progress_bar="none",
                  model=MODEL, data={"mixture": mixture, "eval_files": str(tmp_path / "web.jsonl")},
                  sample={"max_new_tokens": 0})  # fmt: skip
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump({**values, **fields}))
    return str(path)


def test_a_mixture_of_files_trains_logs_each_source_and_evaluates(tmp_path):
    write_sources(tmp_path)
    mixture = [
        {"name": "web", "files": str(tmp_path / "web.jsonl"), "weight": 3},
        {"name": "code", "files": str(tmp_path / "code.jsonl"), "weight": 1},
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-m", "jaxtrain.cli", "train", config(tmp_path, mixture)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    logs = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["mixture/web/share"] for r in logs] == [0.75, 0.75]
    assert all("mixture/code/loss" in r and "mixture/code/epoch" in r for r in logs)
    evaluated = subprocess.run(
        [sys.executable, "-m", "jaxtrain.cli", "eval", str(tmp_path / "run")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "eval/loss:" in evaluated.stdout


@pytest.mark.parametrize(
    ("mixture", "fields", "message"),
    [
        ([{"name": "web", "file": "x.jsonl"}], {}, "data.mixture.0.*did you mean .*files"),
        ([{"name": "web"}], {}, r"data.mixture\[0\] needs files"),
        ([{"name": "a", "files": "a"}, {"name": "a", "files": "b"}], {}, "used twice"),
        ([{"name": "a", "files": "a", "weight": -1}], {}, r"mixture_weights\['a'\]=-1.0 is neg"),
        (
            [{"name": "a", "files": "a", "weight": 1}],
            {"mixture_weights": {"a": 2}},
            "give them once",
        ),
        ([{"name": "a", "files": "a"}], {"mixture_weights": {"b": 1}}, r"names \['b'\]"),
        ("web.jsonl", {}, r"data.mixture\[0\] must be a mapping with name and files"),
    ],
)
def test_mixture_section_errors_are_one_line_before_any_data(tmp_path, capsys, mixture, fields,
                                                            message):  # fmt: skip
    assert main(["train", config(tmp_path, mixture, **fields)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert re.search(message, err), err
