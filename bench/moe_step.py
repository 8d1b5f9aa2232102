"""MoE train-step throughput on CPU against a dense model of equal active parameters.

    .venv/bin/python bench/moe_step.py                 # 4 rounds (~5 min on 2 idle cores)
    .venv/bin/python bench/moe_step.py --rounds 6 --steps 10 --variants dense,moe,moe_ragged

Each variant runs in its own process (``--worker VARIANT``), the order alternating between
rounds; every worker times steps 2..N of the same jitted ``make_train_step`` (AdamW, the
Trainer's default loss, so the MoE variants include the router losses):

- ``dense``: a Llama with intermediate size k * I_expert (the MoE's active MLP width);
- ``moe``: 8 experts of I_expert, top-2, the default dispatch on CPU (blocked grouped
  matmul, dropless);
- ``moe_ragged``: the same MoE with ``moe_implementation="ragged_dot"``, which XLA:CPU
  computes densely over all experts (why it is not the CPU default).

Prints tokens/s per variant (median over rounds) and the median of per-round ratios to dense.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

HIDDEN, EXPERT_INTER, LAYERS, HEADS, SEQ, BATCH, EXPERTS, TOP_K = 256, 512, 4, 4, 256, 8, 8, 2
VARIANTS = ("dense", "moe", "moe_ragged")


def worker(variant: str, steps: int) -> dict:
    import jax
    import optax
    from flax import nnx

    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.models.moe import MoeConfig, MoeForCausalLM
    from jaxtrain.state import TrainState
    from jaxtrain.training.step import make_train_step

    common = dict(vocab_size=4096, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=HEADS)  # fmt: skip
    if variant == "dense":
        model = LlamaForCausalLM(
            LlamaConfig(**common, intermediate_size=TOP_K * EXPERT_INTER), rngs=nnx.Rngs(0)
        )
    else:
        config = MoeConfig(
            **common, intermediate_size=EXPERT_INTER, num_experts=EXPERTS,
            num_experts_per_tok=TOP_K, router_aux_loss_coef=0.01,
            moe_implementation="ragged_dot" if variant == "moe_ragged" else None,
        )  # fmt: skip
        model = MoeForCausalLM(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adamw(3e-4)
    state = TrainState.create(params, optimizer)
    step = jax.jit(
        make_train_step(graphdef=graphdef, rest=rest, optimizer=optimizer,
                        schedule=optax.constant_schedule(3e-4), seed=0),
        donate_argnums=0,
    )  # fmt: skip
    ids = np.random.default_rng(1).integers(0, 4096, (1, BATCH, SEQ), dtype=np.int32)
    batch = {"input_ids": ids, "labels": ids}
    state, _ = step(state, batch)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps - 1):
        start = time.perf_counter()
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"variant": variant, "step_s": step_s, "tokens_per_s": BATCH * SEQ / step_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--variants", default="dense,moe")
    parser.add_argument("--worker")
    opts = parser.parse_args()
    if opts.worker:
        print("RESULT " + json.dumps(worker(opts.worker, opts.steps)))
        return
    variants = opts.variants.split(",")
    runs: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(opts.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            cmd = [sys.executable, __file__, "--worker", v, "--steps", str(opts.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            line = next(x for x in out.splitlines() if x.startswith("RESULT "))
            runs[v].append(json.loads(line[7:])["tokens_per_s"])
        print(f"round {r + 1}: " + ", ".join(f"{v} {runs[v][-1]:.0f} tok/s" for v in variants))
    base = runs[variants[0]]
    print(f"\n{opts.rounds} rounds, {opts.steps} steps each, batch {BATCH} x {SEQ}")
    print(f"| variant | tok/s (median) | runs | vs {variants[0]} (median of rounds) |")
    print("| --- | --- | --- | --- |")
    for v in variants:
        ratio = statistics.median(a / b for a, b in zip(runs[v], base, strict=True))
        spread = " / ".join(f"{x:.0f}" for x in runs[v])
        print(f"| {v} | {statistics.median(runs[v]):.0f} | {spread} | {ratio:.3f}x |")


if __name__ == "__main__":
    main()
