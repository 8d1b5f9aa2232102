"""What the loop reads of the Trainer (the loop and its hooks type against this, not against
the Trainer class: trainer.py imports the loop, nothing imports back)."""

from __future__ import annotations

from typing import Any, Protocol

from jaxtrain.arguments import TrainingArguments
from jaxtrain.training.hooks import HookSet

__all__ = ["RunParts"]


class RunParts(Protocol):
    """The Trainer as one run of the loop sees it (jaxtrain/training/trainer.py)."""

    arguments: TrainingArguments
    program: Any  # training.program.Program
    runtime: Any  # jaxtrain.runtime.Runtime
    monitor: Any  # observability.RunMonitor
    checkpoints: Any  # trainer_checkpoints.RunCheckpointer
    train_source: Any  # data.batch_source.BatchSource
    should_stop: bool

    @property
    def hooks(self) -> HookSet: ...

    @property
    def evaluates(self) -> bool: ...

    def evaluate(self, state: Any) -> dict[str, float]: ...
