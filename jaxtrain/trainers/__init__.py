"""Task trainers on the base Trainer: SFT, DPO, reward model, distillation, GRPO (and LoRA,
which TrainingArguments turns on for any of them)."""

from jaxtrain.trainers.distill import DistillationArguments, DistillationTrainer
from jaxtrain.trainers.dpo import DPOArguments, DPOTrainer, dpo_losses, reference_logps
from jaxtrain.trainers.frozen import Frozen, TaskModel, freeze
from jaxtrain.trainers.grpo import GRPOArguments, GRPOTrainer
from jaxtrain.trainers.grpo_loss import group_advantages, grpo_loss
from jaxtrain.trainers.reward import RewardModel, RewardTrainer
from jaxtrain.trainers.sft import SFTArguments, SFTTrainer

__all__ = [
    "DPOArguments",
    "DPOTrainer",
    "DistillationArguments",
    "DistillationTrainer",
    "Frozen",
    "GRPOArguments",
    "GRPOTrainer",
    "RewardModel",
    "RewardTrainer",
    "SFTArguments",
    "SFTTrainer",
    "TaskModel",
    "dpo_losses",
    "freeze",
    "group_advantages",
    "grpo_loss",
    "reference_logps",
]
