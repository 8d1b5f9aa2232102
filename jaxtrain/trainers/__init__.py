"""Task trainers on the base Trainer: SFT, DPO, KTO, ORPO, CPO/SimPO, reward model,
distillation, GRPO, RLOO (and LoRA, which TrainingArguments turns on for any of them)."""

from jaxtrain.trainers.cpo import CPOArguments, CPOTrainer, cpo_losses
from jaxtrain.trainers.distill import DistillationArguments, DistillationTrainer
from jaxtrain.trainers.dpo import DPOArguments, DPOTrainer, dpo_losses, reference_logps
from jaxtrain.trainers.frozen import Frozen, TaskModel, freeze
from jaxtrain.trainers.grpo import GRPOArguments, GRPOTrainer
from jaxtrain.trainers.grpo_loss import group_advantages, grpo_loss
from jaxtrain.trainers.kto import KTOArguments, KTOTrainer, kto_losses, unpair_preferences
from jaxtrain.trainers.orpo import ORPOArguments, ORPOTrainer
from jaxtrain.trainers.reward import RewardModel, RewardTrainer
from jaxtrain.trainers.rloo import RLOOArguments, RLOOTrainer, rloo_advantages
from jaxtrain.trainers.sft import SFTArguments, SFTTrainer

__all__ = [
    "CPOArguments",
    "CPOTrainer",
    "DPOArguments",
    "DPOTrainer",
    "DistillationArguments",
    "DistillationTrainer",
    "Frozen",
    "GRPOArguments",
    "GRPOTrainer",
    "KTOArguments",
    "KTOTrainer",
    "ORPOArguments",
    "ORPOTrainer",
    "RLOOArguments",
    "RLOOTrainer",
    "RewardModel",
    "RewardTrainer",
    "SFTArguments",
    "SFTTrainer",
    "TaskModel",
    "cpo_losses",
    "dpo_losses",
    "freeze",
    "group_advantages",
    "grpo_loss",
    "kto_losses",
    "reference_logps",
    "rloo_advantages",
    "unpair_preferences",
]
