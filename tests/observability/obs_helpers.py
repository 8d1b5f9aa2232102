"""A tiny, fixed-shape training setup for the observability tests: every row has exactly
10 real tokens padded to 16, so throughput counts are known in advance."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
from flax import nnx

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.models import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ, ROW_LEN, BATCH = 64, 16, 10, 8
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def fixed_length_dataset(rows: int = 96) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict(
        {"input_ids": rng.integers(1, VOCAB - 1, size=(rows, ROW_LEN)).tolist()}
    )


def tiny_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**CONFIG), rngs=nnx.Rngs(0))


def obs_arguments(output_dir: str | Path, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(output_dir),
        learning_rate=1e-2,
        max_steps=12,
        total_batch_size=BATCH,
        gradient_accumulation_steps=2,
        max_sequence_length=SEQ,
        logging_steps=2,
        eval_steps=6,
        max_eval_batches=2,
        progress_bar="none",
        report_to=["tensorboard", "wandb", "mlflow"],
        project_name="obs-project",  # the MLflow experiment and the W&B project
        weight_distribution_log_steps=3,
        track_memory=True,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def obs_trainer(output_dir, callbacks=None, **overrides) -> Trainer:
    return Trainer(
        arguments=obs_arguments(output_dir, **overrides),
        model=tiny_model(),
        dataset_train=fixed_length_dataset(),
        dataset_eval=fixed_length_dataset(32),
        callbacks=callbacks,
    )


class StopAt:
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, state, metrics, step):
        if step == self.step:
            trainer.should_stop = True
