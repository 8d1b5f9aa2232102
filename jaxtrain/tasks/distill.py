"""--task distill: a student trained toward a frozen teacher's token distributions (the
teacher from its own `teacher` config section)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxtrain.config.sections import RunSettings
from jaxtrain.errors import ArgumentError
from jaxtrain.task_arguments import DistillationArguments
from jaxtrain.tasks.batches import lm_batch
from jaxtrain.tasks.sft import SFT_ROWS
from jaxtrain.tasks.task import Task, imported


def _teacher(
    sections: dict[str, dict[str, Any]],
    tokenizer: Any,
    settings: RunSettings,
    build_model: Callable[..., Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    teacher = sections["teacher"]
    if not teacher:
        raise ArgumentError(
            "--task distill needs a teacher: a `teacher` section with `pretrained: DIR` "
            "(a local Hugging Face model) or model fields, e.g. --teacher.pretrained DIR."
        )
    model = build_model(teacher, tokenizer, seed=settings.model.seed + 1)
    return {"teacher_model": model}, {"teacher": teacher}


TASK = Task(
    name="distill",
    arguments=DistillationArguments,
    trainer="jaxtrain.trainers.distill:DistillationTrainer",
    rows=SFT_ROWS,
    batch=lm_batch,
    objective=imported("jaxtrain.trainers.distill:distill_objective"),
    frozen=lambda settings: {"teacher": True},
    sections=("teacher",),
    trainer_kwargs=_teacher,
)
