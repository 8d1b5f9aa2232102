"""A tiny, fast, deterministic training setup shared by the checkpoint tests and their
subprocess workers (`python tiny_run.py OUTPUT_DIR MAX_STEPS [--field value ...]`)."""

from __future__ import annotations

import sys

import datasets
import numpy as np
from flax import nnx

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.models import LlamaConfig, LlamaForCausalLM

VOCAB = 64
SEQ = 16


def token_dataset(rows: int = 96, seed: int = 0) -> datasets.Dataset:
    """Random token rows of varied length (so padding differs between micro-batches)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, SEQ + 1, size=rows)
    ids = [rng.integers(1, VOCAB - 1, size=int(n)).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids})


def tiny_model(hidden_size: int = 32, vocab_size: int = VOCAB) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0))


def tiny_arguments(output_dir: str, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=output_dir,
        learning_rate=1e-2,
        warmup_steps=1,
        max_steps=12,
        total_batch_size=8,
        gradient_accumulation_steps=2,
        max_sequence_length=SEQ,
        logging_steps=2,
        progress_bar="none",
        seed=3,
        # report.png (matplotlib, ~0.35 CPU-s a run) is tested by tests/observability/
        # test_run_report.py and drawn by the docs' runs; these runs test other things.
        run_report=False,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def tiny_trainer(output_dir: str, *, model=None, dataset=None, **overrides) -> Trainer:
    return Trainer(
        arguments=tiny_arguments(output_dir, **overrides),
        model=model if model is not None else tiny_model(),
        dataset_train=dataset if dataset is not None else token_dataset(),
    )


def main(argv: list[str]) -> int:
    """Train in a fresh process; larger model so that checkpoint writes take a while."""
    output_dir, max_steps, *rest = argv
    overrides = {rest[i].lstrip("-"): rest[i + 1] for i in range(0, len(rest), 2)}
    arguments = tiny_arguments(output_dir, max_steps=int(max_steps))
    arguments = TrainingArguments.from_dict({**arguments.to_dict(), **overrides})
    trainer = Trainer(
        arguments=arguments,
        model=tiny_model(hidden_size=128, vocab_size=4096),
        dataset_train=token_dataset(),
    )
    print("training", flush=True)
    trainer.train()
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
