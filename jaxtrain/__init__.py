"""jaxtrain: train and fine-tune transformer models in JAX with one API."""

import os

# jaxtrain uses transformers for tokenizers only; its "PyTorch was not found" advice is noise.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


from jaxtrain.arguments import TrainingArguments
from jaxtrain.errors import (
    ArgumentError,
    CheckpointError,
    DatasetError,
    DistributedError,
    HFError,
    JaxtrainError,
    NonFiniteLossError,
    ReportError,
    TrackerError,
    TrainingInterrupted,
)
from jaxtrain.parallel import ModelFactory
from jaxtrain.training.hooks import TrainerCallback
from jaxtrain.training.state import TrainState
from jaxtrain.training.trainer import Trainer, TrainerOutput

__all__ = [
    "ArgumentError",
    "CheckpointError",
    "DatasetError",
    "DistributedError",
    "HFError",
    "JaxtrainError",
    "ModelFactory",
    "NonFiniteLossError",
    "ReportError",
    "TrackerError",
    "Trainer",
    "TrainerCallback",
    "TrainerOutput",
    "TrainingArguments",
    "TrainState",
    "TrainingInterrupted",
]
__version__ = "0.1.0"
