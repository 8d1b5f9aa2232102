"""`jaxtrain train --task TASK`: the trainer of a task and what it needs besides the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxtrain.errors import ArgumentError

PAIR_TASKS = ("dpo", "reward", "kto", "orpo", "cpo")


def check_task_data(task: str, config: dict[str, Any]) -> None:
    """What a task needs from the data section and the flags of the resolved (raw) config,
    said in flags, before the arguments are built (their checks import JAX)."""
    data = config.get("data") or {}
    files = data.get("source", "default") == "files"
    if task in PAIR_TASKS and not files:
        raise ArgumentError(
            f"--task {task} trains on preference rows (prompt, chosen, rejected"
            f"{'; or prompt, completion, label' if task == 'kto' else ''}): set "
            "--data.source files --data.train_files PAIRS.jsonl (and --data.tokenizer DIR)."
        )
    if task != "grpo":
        return
    if not files:
        raise ArgumentError(
            "--task grpo samples completions of prompts and scores them with reward functions: "
            "set --data.source files --data.train_files PROMPTS.jsonl (rows with a `prompt`, "
            "plus the columns your rewards read, e.g. `answer`) and --reward "
            "last_number_matches (or module:function)."
        )
    if data.get("eval_files"):
        raise ArgumentError(
            "--task grpo does not evaluate during training yet: drop --data.eval_files."
        )
    if not config.get("reward"):
        raise ArgumentError(
            "--task grpo needs reward functions: --reward last_number_matches, format_regex "
            "(with --format_pattern REGEX) or module:function, comma-separated."
        )


def task_trainer(
    task: str,
    config: dict[str, Any],
    data: dict[str, Any],
    tokenizer: Any,
    args: Any,
    build_model: Callable[..., Any],
) -> tuple[type, dict[str, Any], dict[str, Any]]:
    """(trainer class, its extra keyword arguments, what the resolved config.yaml records)."""
    from jaxtrain.cli.run_config import typed_model_section
    from jaxtrain.trainers.tasks import task_classes

    _, trainer_class = task_classes(task)
    check_task_data(task, {**config, "data": data})
    kwargs: dict[str, Any] = {}
    recorded: dict[str, Any] = {"task": task}
    if task == "distill":
        teacher = typed_model_section(config.get("teacher") or {})
        if not teacher:
            raise ArgumentError(
                "--task distill needs a teacher: a `teacher` section with `pretrained: DIR` "
                "(a local Hugging Face model) or model fields, e.g. --teacher.pretrained DIR."
            )
        kwargs["teacher_model"] = build_model(teacher, tokenizer, seed=args.seed + 1)
        recorded["teacher"] = teacher
    elif config.get("teacher"):
        raise ArgumentError(f"the teacher section is for --task distill, not --task {task}.")
    return trainer_class, kwargs, recorded
