"""Packed training, useful targets per second: the Trainer against the hand-written floor.

    .venv/bin/python bench/packed_vs_handwritten.py [--rounds 3] [--steps 16] [--warmup 3]

Both variants train on the same packed rows of the stdlib "definitions" documents (the cut of
bench/packing_utilisation.py: every module of the embedded corpus cut before each top-level
def/class, median ~170 tokens), S1 shape (hidden 256, 4 layers, 4 heads, seq 256, batch 8),
AdamW at a constant learning rate, each variant in its own process, order alternating:

- ``trainer``: ``Trainer(packing=True)`` on the documents (its best-fit packer; long documents
  split), the whole loop: data, step, metrics;
- ``handwritten``: bench/handwritten_llama.py (pure JAX, ``packed_loss``: per-document rotary
  positions and a same-document causal mask) on exactly the rows the Trainer's loader packs
  (``build_train_loader`` with the same arguments), in a bare jitted loop.

"useful targets/s" counts the labelled targets (positions whose next token is a real target
of its own document) per second over steps W+1..N. Prints the medians and the median of the
per-round ratios trainer / handwritten (issue 12 goal 3: >= 1.05).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handwritten_llama import LlamaShape  # noqa: E402 - bench/ is not a package

SHAPE = LlamaShape(vocab=4096, hidden=256, intermediate=1024, layers=4, heads=4, seq=256, batch=8)
PREFIX = "BENCH_RESULT "


def documents() -> list[dict]:
    from jaxtrain.data import load_default_corpus

    corpus = load_default_corpus(vocab_size=SHAPE.vocab)
    texts = corpus.train["text"]
    cut = [d for t in texts for d in re.split(r"\n(?=(?:def|class|@) )", t) if d.strip()]
    ids = corpus.tokenizer(cut, add_special_tokens=False)["input_ids"]
    return [{"input_ids": x} for x in ids]


def arguments(out_dir: str, steps: int):
    from jaxtrain import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir, seed=0, learning_rate=3e-4, optimizer="adamw", scheduler="constant",
        weight_decay=0.0, clip_grad=None, max_steps=steps, total_batch_size=SHAPE.batch,
        max_sequence_length=SHAPE.seq, packing=True, logging_steps=1000,
        evaluation_strategy="no", save_final=False, progress_bar="none", run_report=False,
    )  # fmt: skip


def model_config():
    from jaxtrain.models import LlamaConfig

    return LlamaConfig(
        vocab_size=SHAPE.vocab, hidden_size=SHAPE.hidden, intermediate_size=SHAPE.intermediate,
        num_hidden_layers=SHAPE.layers, num_attention_heads=SHAPE.heads,
        num_key_value_heads=SHAPE.heads, rms_norm_eps=SHAPE.eps, rope_theta=SHAPE.rope_theta,
    )  # fmt: skip


def run_trainer(docs: list[dict], steps: int, warmup: int) -> dict:
    import jax
    from flax import nnx

    from jaxtrain import Trainer, TrainerCallback
    from jaxtrain.models import LlamaForCausalLM

    marks, targets = {}, []

    class Clock(TrainerCallback):
        def on_step_end(self, trainer, state, metrics, step):
            targets.append(metrics["tokens"])
            if step in (warmup, steps):
                jax.block_until_ready(state)
                marks[step] = time.perf_counter()

    model = LlamaForCausalLM(model_config(), rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as out:
        Trainer(
            arguments=arguments(out, steps), model=model, dataset_train=docs, callbacks=[Clock()]
        ).train()
    useful = float(sum(jax.device_get(targets[warmup:steps])))
    return {"useful_per_s": useful / (marks[steps] - marks[warmup]), "useful": useful}


def run_handwritten(docs: list[dict], steps: int, warmup: int) -> dict:
    import handwritten_llama as hw
    import jax
    import optax

    from jaxtrain.data import build_train_loader

    with tempfile.TemporaryDirectory() as out:
        loader = build_train_loader(arguments(out, steps), docs, pad_token_id=0)
        it = loader.batches()
        batches = [{k: np.asarray(v)[0] for k, v in next(it).items()} for _ in range(steps)]
    params = hw.init_params(jax.random.key(0), SHAPE)
    tx = optax.adamw(3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)

    def train_step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(hw.packed_loss)(params, batch, SHAPE)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    step_fn = jax.jit(train_step, donate_argnums=0)
    state, marks = (params, tx.init(params)), {}
    for step, batch in enumerate(batches, start=1):
        state, _ = step_fn(state, batch)
        if step in (warmup, steps):
            jax.block_until_ready(state)
            marks[step] = time.perf_counter()
    useful = float(sum((b["labels"][:, 1:] != -100).sum() for b in batches[warmup:steps]))
    return {"useful_per_s": useful / (marks[steps] - marks[warmup]), "useful": useful}


RUNNERS = {"trainer": run_trainer, "handwritten": run_handwritten}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", choices=sorted(RUNNERS))
    opts = parser.parse_args()
    if opts.worker:
        result = RUNNERS[opts.worker](documents(), opts.steps, opts.warmup)
        print(PREFIX + json.dumps(result), flush=True)
        return
    runs: dict[str, list[dict]] = {v: [] for v in RUNNERS}
    for r in range(opts.rounds):
        order = list(RUNNERS) if r % 2 == 0 else list(RUNNERS)[::-1]
        for variant in order:
            cmd = [sys.executable, __file__, "--worker", variant]
            cmd += ["--steps", str(opts.steps), "--warmup", str(opts.warmup)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith(PREFIX)]
            if proc.returncode or not lines:
                sys.exit(f"worker {variant} failed:\n{proc.stderr[-3000:]}")
            runs[variant].append(json.loads(lines[-1][len(PREFIX) :]))
            print(f"round {r + 1}: {variant} {runs[variant][-1]['useful_per_s']:.0f} useful/s",
                  flush=True)  # fmt: skip
    ratios = [t["useful_per_s"] / h["useful_per_s"] for t, h in zip(*runs.values(), strict=True)]
    print(f"\n{opts.rounds} rounds, steps {opts.warmup + 1}..{opts.steps}")
    print("| variant | useful targets/s (median) | runs |\n| --- | --- | --- |")
    for variant, rs in runs.items():
        values = [x["useful_per_s"] for x in rs]
        print(f"| {variant} | {statistics.median(values):.0f} | "
              + " / ".join(f"{v:.0f}" for v in values) + " |")  # fmt: skip
    print(f"trainer / handwritten: median {statistics.median(ratios):.3f}, "
          f"rounds {', '.join(f'{x:.3f}' for x in ratios)}")  # fmt: skip
    assert runs["trainer"][0]["useful"] == runs["handwritten"][0]["useful"], "different rows"


if __name__ == "__main__":
    main()
