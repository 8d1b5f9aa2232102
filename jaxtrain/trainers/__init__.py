"""Task trainers on the base Trainer: SFT, DPO, reward model, distillation (and LoRA, which
TrainingArguments turns on for any of them)."""

from jaxtrain.trainers.dpo import DPOArguments, DPOTrainer, dpo_losses, reference_logps
from jaxtrain.trainers.frozen import Frozen, TaskModel, freeze

__all__ = [
    "DPOArguments",
    "DPOTrainer",
    "Frozen",
    "TaskModel",
    "dpo_losses",
    "freeze",
    "reference_logps",
]
