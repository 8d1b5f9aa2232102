"""The tasks of `jaxtrain train --task TASK`: each names its arguments class and trainer."""

from __future__ import annotations

from typing import Any

from jaxtrain.arguments import ArgumentError, TrainingArguments

__all__ = ["TASKS", "task_classes"]

# task -> (arguments class, trainer class path, rows it reads)
TASKS: dict[str, tuple[str, str, str]] = {
    "lm": ("TrainingArguments", "jaxtrain.training.trainer.Trainer", "text or input_ids"),
    "sft": (
        "SFTArguments",
        "jaxtrain.trainers.sft.SFTTrainer",
        "text, messages or prompt+completion",
    ),
    "dpo": ("DPOArguments", "jaxtrain.trainers.dpo.DPOTrainer", "prompt, chosen, rejected"),
    "reward": (
        "TrainingArguments",
        "jaxtrain.trainers.reward.RewardTrainer",
        "prompt, chosen, rejected",
    ),
    "distill": (
        "DistillationArguments",
        "jaxtrain.trainers.distill.DistillationTrainer",
        "text, messages or prompt+completion",
    ),
}


def task_classes(task: str) -> tuple[type[TrainingArguments], Any]:
    """(arguments class, trainer class) of `task`; ArgumentError naming the known tasks."""
    import importlib

    if task not in TASKS:
        raise ArgumentError(
            f"--task {task!r} is not a task; use one of {', '.join(TASKS)} "
            "(lm: the plain causal LM Trainer)."
        )
    arguments_name, trainer_path, _ = TASKS[task]
    module_name, _, class_name = trainer_path.rpartition(".")
    trainer_cls = getattr(importlib.import_module(module_name), class_name)
    if arguments_name == "TrainingArguments":
        return TrainingArguments, trainer_cls
    from jaxtrain import trainers

    return getattr(trainers, arguments_name), trainer_cls
