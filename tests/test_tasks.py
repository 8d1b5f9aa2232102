"""One definition per task (jaxtrain/tasks): the command line, `plan`, a restored run and the
help read each task from its module there, and nothing else in the package names a task.
Read from the code itself, so no run can hide a second table."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import jaxtrain
from jaxtrain.arguments import TrainingArguments
from jaxtrain.config.sections import RunSettings
from jaxtrain.errors import ArgumentError
from jaxtrain.tasks import TASKS, get_task

PACKAGE = Path(jaxtrain.__file__).parent
TASK_NAMES = set(TASKS)


def _task_names_in(node: ast.AST) -> set[str]:
    """The task names a literal (a string, or a tuple/list/set/dict's keys) holds."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & TASK_NAMES
    items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
    if not isinstance(node, ast.Dict | ast.Tuple | ast.List | ast.Set):
        return set()
    return {i.value for i in items if isinstance(i, ast.Constant)} & TASK_NAMES


def _names_a_task(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return text.split(".")[-1].endswith("task") or "task" in text.split(".")[-1].split("_")


def task_mentions(path: Path) -> list[str]:
    """`file:line code` of each comparison of a task with a task name, and each literal table
    holding two task names or more."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_a_task(s) for s in sides) and any(_task_names_in(s) for s in sides):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
        elif len(_task_names_in(node)) >= 2:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} a table of tasks")
    return found


def test_no_module_outside_the_task_definitions_names_a_task():
    """Once eight places held a task (three tables, two tuples of pair tasks, two if-chains in
    the planner, string tests in the CLI) and they drifted: GRPO's plan compiled another
    sampler, a GRPO run directory could not be exported."""
    outside = [p for p in PACKAGE.rglob("*.py") if PACKAGE / "tasks" not in p.parents]
    found = [line for path in outside for line in task_mentions(path)]
    assert not found, "task names outside jaxtrain/tasks:\n" + "\n".join(found)


def test_the_static_check_finds_what_it_forbids(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        'PAIRS = ("dpo", "kto")\n'
        'def f(task, run):\n    return task == "grpo" or run.sections.task in ("sft",)\n'
    )
    global PACKAGE
    package, PACKAGE = PACKAGE, tmp_path
    try:
        assert len(task_mentions(planted)) == 3
    finally:
        PACKAGE = package


def test_every_module_of_the_package_defining_a_task_is_found_by_its_name():
    modules = [m.name for m in pkgutil.iter_modules([str(PACKAGE / "tasks")])]
    defined = [
        name
        for name in modules
        if getattr(importlib.import_module(f"jaxtrain.tasks.{name}"), "TASK", None)
    ]
    assert sorted(defined) == sorted(TASKS)
    for name, task in TASKS.items():
        assert task.name == name == importlib.import_module(f"jaxtrain.tasks.{name}").TASK.name
    assert list(TASKS)[0] == "lm"  # the default, listed first


@pytest.mark.parametrize("name", sorted(TASK_NAMES))
def test_each_definition_names_its_classes_and_shapes(name):
    task = get_task(name)
    from jaxtrain.training.trainer import Trainer

    assert issubclass(task.arguments, TrainingArguments)
    assert issubclass(task.trainer_class(), Trainer)
    args = task.arguments(max_steps=2, total_batch_size=8, gradient_accumulation_steps=2)
    batch = task.batch(RunSettings.from_arguments(args))
    assert {v.shape[0] for v in batch.values()} == {2}  # [A, ...]
    assert (2, args.micro_batch_size) == batch["input_ids"].shape[:2]
    assert task.generates == (name != "reward")
    if task.objective is None:
        assert "labels" in batch and not task.wrapped


# SFT's class only changes defaults (packing, completion-only loss): SFTTrainer takes plain
# TrainingArguments as the HF Trainer would. Every other class adds fields its trainer reads.
ADDS_FIELDS = sorted(
    n for n, t in TASKS.items() if t.arguments is not TrainingArguments and n != "sft"
)


@pytest.mark.parametrize("name", ADDS_FIELDS)
def test_a_task_trainer_given_plain_arguments_names_the_class_it_needs(name):
    """Once six messages written by hand, which had drifted apart; the check comes before
    any model or data is looked at (model=None here)."""
    import dataclasses

    task = get_task(name)
    with pytest.raises(ArgumentError) as refused:
        task.trainer_class()(arguments=TrainingArguments(max_steps=1), model=None)
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    first_own = next(f.name for f in dataclasses.fields(task.arguments) if f.name not in base)
    message = str(refused.value)
    assert message.startswith(f"{task.trainer_class().__name__} needs"), message
    assert f"needs {task.arguments.__name__} (TrainingArguments plus {first_own}" in message
    assert f"got TrainingArguments: build {task.arguments.__name__}(...)" in message


def test_an_unknown_task_is_refused_naming_the_tasks():
    with pytest.raises(ArgumentError, match="'rlhf' is not a task; use one of lm, cpo"):
        get_task("rlhf")


def test_the_definitions_import_no_jax():
    code = (
        "import sys, jaxtrain.tasks; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_command_line_builds_the_sections_once_and_hands_them_to_the_trainer():
    """`trainer_setup` (the CLI's, a restored run's) builds the run's sections and passes them
    on as `settings=`: the trainer reads those, and builds none of its own."""
    from flax import nnx

    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.tasks import trainer_setup

    for name, task in TASKS.items():
        if task.trainer_kwargs is not None:  # distill: its teacher is built (the CLI's tests)
            continue
        # What each task's check of the config asks for (files, a tokenizer, RL's rewards).
        config, data = {"reward": "last_number_matches"}, {"source": "files", "tokenizer": "t"}
        args = task.arguments(max_steps=1)
        trainer_class, kwargs, recorded = trainer_setup(name, config, data, None, args, None, None)
        assert trainer_class is task.trainer_class() and recorded == {"task": name}
        assert kwargs == {"settings": RunSettings.from_arguments(args)}, name
    args = TrainingArguments(max_steps=1, total_batch_size=2, max_sequence_length=8)
    trainer_class, kwargs, _ = trainer_setup("lm", {}, {}, None, args, None, None)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    rows = [{"input_ids": list(range(8))} for _ in range(4)]
    trainer = trainer_class(arguments=args, model=model, dataset_train=rows, **kwargs)
    assert trainer.settings is kwargs["settings"]
