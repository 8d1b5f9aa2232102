"""Shared setup of the parallelism tests and their subprocess workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
from flax import nnx

from jaxtrain import TrainingArguments
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.parallel import ModelFactory

ROOT = Path(__file__).resolve().parent.parent.parent


def run_worker(script: str, *args: str) -> object:
    """Run tests/parallel/`script` with `args` in its own process (its own devices); its last
    stdout line is its JSON report."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), *args],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_env() -> dict[str, str]:
    """The environment of a worker subprocess: CPU only, jaxtrain importable; the worker adds
    its device count to the suite's XLA_FLAGS (tests/conftest.py)."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


VOCAB = 64
SEQ = 16
MESHES = {
    "single": (1, 1, 1, 1, 1),
    "dp8": (8, 1, 1, 1, 1),
    "fsdp8": (1, 8, 1, 1, 1),
    "dp2_fsdp2_tp2": (2, 2, 1, 2, 1),
    "fsdp4_sp2": (1, 4, 1, 1, 2),
}
CONFIG = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def token_dataset(rows: int = 64, seed: int = 0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, SEQ + 1, size=rows)
    ids = [rng.integers(1, VOCAB - 1, size=int(n)).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids})


def eval_dataset() -> datasets.Dataset:
    return token_dataset(rows=20, seed=1)  # two eval batches of 16, the last one padded


def factory() -> ModelFactory:
    return ModelFactory(lambda: LlamaForCausalLM(CONFIG, rngs=nnx.Rngs(0)))


def parallel_arguments(output_dir: str, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=output_dir,
        optimizer="adamw",
        # A large epsilon keeps Adam from amplifying float rounding of tiny gradients, so
        # parameters of different meshes can be compared at a tight tolerance.
        adam_epsilon=1e-3,
        learning_rate=1e-2,
        warmup_steps=1,
        max_steps=3,
        total_batch_size=16,
        max_sequence_length=SEQ,
        logging_steps=1,
        evaluation_strategy="no",
        save_final=False,
        progress_bar="none",
        seed=3,
        run_report=False,  # tested in tests/observability (matplotlib: ~0.7 CPU-s a process)
    )
    values.update(overrides)
    return TrainingArguments(**values)


class LossRecorder:
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, trainer, logs, step) -> None:
        self.losses.append(float(logs["loss"]))
