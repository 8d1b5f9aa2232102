"""Which settings compile a new train step: runs that differ in one optimizer number, each in
its own process on one fresh compilation cache, as a user re-running with another value would.

    .venv/bin/python bench/compile_keys.py            # ~1 minute on 2 cores

Prints, per run, the train step's compile time and the cache entries the run added. A run
that adds none read its step from the cache; one that adds one compiled it again, because a
setting it changed is a constant of the program (bench/RESULTS.md: every optimizer number was,
session 67; none is since session 68, where turning weight decay off still compiles).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# (label, TrainingArguments overrides): the first is the reference the others change.
RUNS = [
    ("reference", {}),
    ("same again", {}),
    ("learning_rate 2e-3", {"learning_rate": 2e-3}),
    ("warmup_steps 3", {"warmup_steps": 3}),
    ("max_steps 6", {"max_steps": 6}),
    ("weight_decay 0.1", {"weight_decay": 0.1}),
    ("clip_grad 0.5", {"clip_grad": 0.5}),
    ("weight_decay 0 (off)", {"weight_decay": 0.0}),  # no decay op: another program
    ("total_batch_size 16", {"total_batch_size": 16}),  # a new shape: compiles by design
]
BASE = dict(learning_rate=1e-3, warmup_steps=2, max_steps=4, weight_decay=0.01, total_batch_size=8,
            max_sequence_length=32, evaluation_strategy="no", run_report=False,
            progress_bar="none", save_steps=1000)  # fmt: skip


def worker(overrides: dict, out: str) -> None:
    from flax import nnx

    from jaxtrain import Trainer, TrainingArguments
    from jaxtrain.models import LlamaConfig, LlamaForCausalLM

    rows = [{"input_ids": [(i * 7 + j) % 60 + 1 for j in range(32)]} for i in range(64)]
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    arguments = TrainingArguments(output_dir=out, **{**BASE, **overrides})
    Trainer(arguments=arguments, model=model, dataset_train=rows).train()


def train_step_entries(cache: Path) -> int:
    """Programs, not files: with a size cap JAX writes an access-time file beside each."""
    return sum(1 for p in cache.glob("jit_train_step-*-cache"))


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        cache = Path(scratch) / "xla"
        cache.mkdir()
        # Every program kept, however fast it compiled: with JAX's 1 s floor a machine that
        # compiles this step faster would keep none and report each run as a read.
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PLATFORMS": "cpu",
               "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}  # fmt: skip
        print(f"{'run':<22} {'compile s':>9} {'new train steps':>16}")
        for index, (label, overrides) in enumerate(RUNS):
            before = train_step_entries(cache)
            out = Path(scratch) / f"run{index}"
            command = [sys.executable, __file__, "--worker", json.dumps(overrides), str(out)]
            subprocess.run(command, env=env, check=True, capture_output=True)
            logged = [json.loads(line) for line in (out / "metrics.jsonl").open()]
            seconds = next(r["compile/train_step_s"] for r in logged if "compile/train_step_s" in r)
            added = train_step_entries(cache) - before
            print(f"{label:<22} {seconds:>9.2f} {added:>16}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]), sys.argv[3])
    else:
        main()
