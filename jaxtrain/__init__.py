"""jaxtrain: train and fine-tune transformer models in JAX with one API."""

import os

# jaxtrain uses transformers for tokenizers only; its "PyTorch was not found" advice is noise.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.checkpointing import CheckpointError
from jaxtrain.data.errors import DatasetError
from jaxtrain.hf.errors import HFError
from jaxtrain.parallel import DistributedError, ModelFactory
from jaxtrain.training.hooks import TrainerCallback
from jaxtrain.training.state import TrainState
from jaxtrain.training.stopping import NonFiniteLossError, TrainingInterrupted
from jaxtrain.training.trackers import TrackerError
from jaxtrain.training.trainer import Trainer, TrainerOutput

__all__ = [
    "ArgumentError",
    "CheckpointError",
    "DatasetError",
    "DistributedError",
    "HFError",
    "ModelFactory",
    "NonFiniteLossError",
    "TrackerError",
    "Trainer",
    "TrainerCallback",
    "TrainerOutput",
    "TrainingArguments",
    "TrainState",
    "TrainingInterrupted",
]
__version__ = "0.1.0"
