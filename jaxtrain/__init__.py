"""jaxtrain: train and fine-tune transformer models in JAX with one API."""

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.training.hooks import TrainerCallback
from jaxtrain.training.state import TrainState
from jaxtrain.training.trainer import Trainer, TrainerOutput

__all__ = [
    "ArgumentError",
    "Trainer",
    "TrainerCallback",
    "TrainerOutput",
    "TrainingArguments",
    "TrainState",
]
__version__ = "0.1.0"
