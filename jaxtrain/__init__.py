"""jaxtrain: train and fine-tune transformer models in JAX with one API."""

import os

# jaxtrain uses transformers for tokenizers only; its "PyTorch was not found" advice is noise.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


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

# The rest is imported on first use: `import jaxtrain` stays light (errors.py imports nothing
# heavy), so the command line installs its Ctrl-C handling before JAX is even imported.
_LAZY = {
    "TrainingArguments": "jaxtrain.arguments",
    "ModelFactory": "jaxtrain.parallel",
    "TrainerCallback": "jaxtrain.training.hooks",
    "TrainState": "jaxtrain.state",
    "Trainer": "jaxtrain.training.trainer",
    "TrainerOutput": "jaxtrain.training.trainer",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'jaxtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


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
