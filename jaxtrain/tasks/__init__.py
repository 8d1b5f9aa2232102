"""The tasks of `jaxtrain train --task NAME`: one module per task in this package, each
defining `TASK = Task(...)` (jaxtrain/tasks/task.py). The registry finds them, so adding a task
adds one module here (plus its arguments class, trainer and tests); the command line, `jaxtrain
plan`, a restored run directory and the help read nothing else.

Importing this package imports no JAX.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

from jaxtrain.arguments import task_fields
from jaxtrain.config.sections import RunSettings
from jaxtrain.errors import ArgumentError
from jaxtrain.tasks.task import Task

__all__ = [
    "DEFAULT_TASK",
    "TASKS",
    "Task",
    "check_task_fields",
    "get_task",
    "task_of_field",
    "trainer_setup",
]

DEFAULT_TASK = "lm"  # `jaxtrain train` without --task: the plain causal LM Trainer


def _find_tasks() -> dict[str, Task]:
    found: dict[str, Task] = {}
    for module in pkgutil.iter_modules(__path__):
        definition = getattr(importlib.import_module(f"{__name__}.{module.name}"), "TASK", None)
        if definition is None:
            continue
        if definition.name in found:
            raise RuntimeError(f"two task modules define --task {definition.name}")
        found[definition.name] = definition
    # The default first, then by name: the order the usage and the help list them in.
    return {name: found[name] for name in sorted(found, key=lambda n: (n != DEFAULT_TASK, n))}


TASKS: dict[str, Task] = _find_tasks()


def get_task(name: str) -> Task:
    """The definition of `--task name`; ArgumentError naming the tasks."""
    if name not in TASKS:
        raise ArgumentError(
            f"--task {name!r} is not a task; use one of {', '.join(TASKS)} "
            f"({DEFAULT_TASK}: the plain causal LM Trainer)."
        )
    return TASKS[name]


def task_of_field(name: str) -> list[str]:
    """The tasks whose arguments class has field `name` and TrainingArguments has not."""
    return [task.name for task in TASKS.values() if name in task_fields(task.arguments)]


def check_task_fields(fields: list[str], task: str, source: str) -> None:
    """ArgumentError when `fields` hold another task's fields (a DPO config's beta given to
    --task reward): it names each field's task and this task's own fields."""
    extra = sorted(task_fields(get_task(task).arguments))
    foreign = {name: task_of_field(name) for name in fields if name not in extra}
    foreign = {name: tasks for name, tasks in foreign.items() if tasks}
    if not foreign:
        return
    listed = "; ".join(
        f"{name} is a field of --task {' / '.join(t)}" for name, t in foreign.items()
    )
    mine = (
        f"its own fields beyond TrainingArguments are {', '.join(extra)}"
        if extra
        else ("it has only the TrainingArguments fields")
    )
    raise ArgumentError(
        f"{source} is used with --task {task}, but {listed}. --task {task} does not read "
        f"them ({mine}): remove them, or run the task they belong to."
    )


def trainer_setup(
    name: str,
    config: dict[str, Any],
    data: dict[str, Any],
    tokenizer: Any,
    args: Any,
    build_model: Callable[..., Any],
    typed_model_section: Callable[[dict[str, Any]], dict[str, Any]],
) -> tuple[type, dict[str, Any], dict[str, Any]]:
    """(trainer class, its extra keyword arguments, what the resolved config.yaml records) of
    a run of task `name` from the command line's resolved config. The keyword arguments hand
    the run's sections (`settings`), built here once, to the trainer. The task's own sections
    (distill's teacher: a model) reach its hook typed by `typed_model_section`, and
    `build_model(section, tokenizer, seed=...)` builds them."""
    task = get_task(name)
    task.check_data({**config, "data": data})
    for other in TASKS.values():
        for section in other.sections:
            if config.get(section) and section not in task.sections:
                raise ArgumentError(
                    f"the {section} section is for --task {other.name}, not --task {name}."
                )
    settings = RunSettings.from_arguments(args)
    kwargs: dict[str, Any] = {"settings": settings}
    recorded: dict[str, Any] = {"task": name}
    if task.trainer_kwargs is not None:
        sections = {s: typed_model_section(config.get(s) or {}) for s in task.sections}
        own, extra = task.trainer_kwargs(sections, tokenizer, settings, build_model)
        kwargs.update(own)
        recorded.update(extra)
    return task.trainer_class(), kwargs, recorded
