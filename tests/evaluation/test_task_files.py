"""Task files are checked before anything runs: a missing file, a missing data file or a task
that would download is one line naming the task and the fix (no model needed here)."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxtrain import TrainingArguments
from jaxtrain.errors import ArgumentError, TaskError
from jaxtrain.evaluation import EXAMPLES, example_tasks, read_task
from jaxtrain.evaluation.harness import TaskSuite, flatten_results

MC = (EXAMPLES / "python_mc.yaml").read_text()


def task_file(tmp_path, text: str, name: str = "task.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def test_the_examples_are_local_and_relative_files_follow_the_yaml(tmp_path, monkeypatch):
    assert example_tasks() == ["python_em", "python_mc"]
    # A copy of the example elsewhere, read from a third directory: data_files are resolved
    # relative to the YAML file, so the task runs from anywhere.
    shutil.copy(EXAMPLES / "python_mc.jsonl", tmp_path / "python_mc.jsonl")
    path = task_file(tmp_path, MC.replace("task: python_mc", "task: my_mc"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = read_task(str(path))
    assert spec.name == "my_mc"
    assert spec.config["dataset_kwargs"]["data_files"] == {
        "test": str(tmp_path / "python_mc.jsonl")
    }
    suite = TaskSuite([str(path), "python_em"], limit=3)  # lm-eval reads the data now
    assert suite.names == ["my_mc", "python_em"] and set(suite.tasks) == {"my_mc", "python_em"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("test: python_mc.jsonl", "test: missing.jsonl"), "data file 'missing.jsonl' does not exist"),
        (("test: python_mc.jsonl", "test: empty.jsonl"), "data file 'empty.jsonl' is empty (0 bytes)"),
        (("dataset_path: json", "dataset_path: cais/mmlu"), "would be downloaded from the Hugging Face Hub"),
        (("test: python_mc.jsonl", "test: hf://datasets/x/y/z.jsonl"), "is a URL, which would be downloaded"),
        (("metric: acc_norm", "metric: sacrebleu_xyz"), "'sacrebleu_xyz' is not one of lm-eval's own"),
        (("task: python_mc", "group: things\ntask: [a, b]"), "is a group of tasks"),
        (("dataset_kwargs:\n  data_files:\n    test: python_mc.jsonl\n", ""), "reads local files; give them"),
    ],
)  # fmt: skip
def test_a_task_that_cannot_run_locally_is_one_line(tmp_path, change, message):
    shutil.copy(EXAMPLES / "python_mc.jsonl", tmp_path / "python_mc.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    old, new = change
    assert old in MC
    path = task_file(tmp_path, MC.replace(old, new))
    with pytest.raises(TaskError) as err:
        read_task(str(path))
    assert message in one_line(err)
    assert str(path) in str(err.value)


def test_a_missing_task_file_names_the_path_and_the_examples(tmp_path):
    with pytest.raises(TaskError) as err:
        read_task(str(tmp_path / "nope.yaml"))
    assert f"no file {tmp_path / 'nope.yaml'}" in one_line(err)
    assert "python_em, python_mc" in str(err.value)
    with pytest.raises(TaskError, match="no such example task"):
        read_task("python_mcq")


def test_a_task_lm_eval_cannot_build_is_one_line(tmp_path):
    rows = [{"question": "a"}, {"question": "b"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = task_file(tmp_path, MC.replace("python_mc.jsonl", "rows.jsonl"))  # no prefix column
    with pytest.raises(TaskError) as err:
        TaskSuite([str(path)])
    assert "lm-eval cannot load it" in one_line(err)


def test_eval_tasks_arguments_are_checked():
    with pytest.raises(ArgumentError, match="evaluation_strategy='no' turns off"):
        TrainingArguments(eval_tasks=["python_mc"], evaluation_strategy="no")
    with pytest.raises(ArgumentError, match="eval_tasks_limit must be > 0"):
        TrainingArguments(eval_tasks=["python_mc"], eval_tasks_limit=0)
    assert TrainingArguments.from_dict({"eval_tasks": "python_mc,a.yaml"}).eval_tasks == [
        "python_mc",
        "a.yaml",
    ]


def test_flattened_results_keep_metrics_and_stderrs_and_name_filters():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1,
                                 "exact_match,strict-match": 1.0, "x_stderr,none": "N/A"}}}  # fmt: skip
    assert flatten_results(results) == {
        "eval/t/acc": 0.5,
        "eval/t/acc_stderr": 0.1,
        "eval/t/exact_match/strict-match": 1.0,
    }
