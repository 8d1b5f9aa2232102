"""The tasks of `jaxtrain train --task TASK`: each names its arguments class and trainer."""

from __future__ import annotations

from typing import Any

from jaxtrain.arguments import TrainingArguments
from jaxtrain.task_arguments import task_arguments_class

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
    "kto": (
        "KTOArguments",
        "jaxtrain.trainers.kto.KTOTrainer",
        "prompt, completion, label (or prompt, chosen, rejected)",
    ),
    "orpo": ("ORPOArguments", "jaxtrain.trainers.orpo.ORPOTrainer", "prompt, chosen, rejected"),
    "cpo": ("CPOArguments", "jaxtrain.trainers.cpo.CPOTrainer", "prompt, chosen, rejected"),
    "grpo": (
        "GRPOArguments",
        "jaxtrain.trainers.grpo.GRPOTrainer",
        "prompt, messages or prompt_ids (+ columns for the rewards)",
    ),
}


def task_classes(task: str) -> tuple[type[TrainingArguments], Any]:
    """(arguments class, trainer class) of `task`; ArgumentError naming the known tasks."""
    import importlib

    arguments_cls = task_arguments_class(task)  # ArgumentError naming the tasks
    _, trainer_path, _ = TASKS[task]
    module_name, _, class_name = trainer_path.rpartition(".")
    trainer_cls = getattr(importlib.import_module(module_name), class_name)
    return arguments_cls, trainer_cls
