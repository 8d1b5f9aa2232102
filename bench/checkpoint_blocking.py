"""How long a checkpoint save blocks the training loop, next to the step time.

    python bench/checkpoint_blocking.py [--models demo,large] [--steps N]

For each model: the median time of a jitted train step (the Trainer's step function, state
donated), the time `RunCheckpoints.save` holds the loop (device-to-host copy, then the files
are written in the background), and the time until the save is committed on disk (which
includes the crc32 checksums of every file, written in Orbax's background thread before the
commit). The ratio "blocked / step" says how many steps' worth of time a save costs the loop.
"checksums s" / "verify s" time writing and verifying the checksums of one committed
checkpoint on their own (the part of "committed" they account for; verify runs at restore).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import datasets
import jax
import numpy as np
from flax import nnx

from jaxtrain import Trainer, TrainingArguments
from jaxtrain.checkpointing import RunCheckpoints
from jaxtrain.checkpointing.checksums import verify_checksums, write_checksums
from jaxtrain.cli.run_config import DEFAULT_CONFIG
from jaxtrain.config.sections import CheckpointSettings
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.training.step import make_train_step

MODELS = {
    "demo": {**DEFAULT_CONFIG["model"], "vocab_size": 4096},
    "large": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
}
BATCH, SEQ = 8, 256


def measure(name: str, steps: int) -> dict[str, float]:
    config = LlamaConfig(**{k: v for k, v in MODELS[name].items() if v is not None})
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    rows = np.random.default_rng(0).integers(1, config.vocab_size, (BATCH, SEQ))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, total_batch_size=BATCH, max_sequence_length=SEQ, max_steps=steps
        )
        trainer = Trainer(
            arguments=args,
            model=model,
            dataset_train=datasets.Dataset.from_dict({"input_ids": rows.tolist()}),
        )
        step_fn = make_train_step(
            graphdef=trainer.program.graphdef,
            rest=trainer.program.rest,
            optimizer=trainer.program.optimizer,
            schedule=trainer.program.schedule,
            seed=0,
        )
        step = jax.jit(step_fn, donate_argnums=0)
        batch = next(trainer.train_source.loader.batches())
        state = trainer.create_state()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)

        checkpointer = RunCheckpoints(CheckpointSettings.from_arguments(args))
        blocked, committed = [], []
        for index in range(3):
            state, _ = step(state, batch)
            jax.block_until_ready(state)
            start = time.perf_counter()
            checkpointer.save(state, metadata={"step": index})
            blocked.append(time.perf_counter() - start)
            checkpointer.wait()
            committed.append(time.perf_counter() - start)
        checkpointer.close()
        step_dir = checkpointer.root / str(int(state.step))
        start = time.perf_counter()
        write_checksums(step_dir)
        checksum_s = time.perf_counter() - start
        start = time.perf_counter()
        assert verify_checksums(step_dir)
        verify_s = time.perf_counter() - start
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    step_time = statistics.median(times)
    save_blocked = statistics.median(blocked)
    return {
        "params_M": trainer.num_parameters / 1e6,
        "state_MB": state_bytes / 1e6,
        "step_s": step_time,
        "save_blocked_s": save_blocked,
        "save_committed_s": statistics.median(committed),
        "blocked_per_step": save_blocked / step_time,
        "checksum_s": checksum_s,
        "verify_s": verify_s,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,large")
    parser.add_argument("--steps", type=int, default=5)
    options = parser.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}, batch {BATCH} x {SEQ} tokens")
    header = ("model", "params M", "state MB", "step s", "save blocks s", "committed s", "ratio")
    header += ("checksums s", "verify s")
    print(" | ".join(header))
    for name in options.models.split(","):
        r = measure(name, options.steps)
        print(
            f"{name} | {r['params_M']:.1f} | {r['state_MB']:.0f} | {r['step_s']:.3f} | "
            f"{r['save_blocked_s']:.3f} | {r['save_committed_s']:.3f} | "
            f"{r['blocked_per_step']:.2f} | {r['checksum_s']:.3f} | {r['verify_s']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
