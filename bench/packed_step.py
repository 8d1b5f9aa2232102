"""Cost of packing in the train step: packed vs unpacked rows at the same shapes.

    .venv/bin/python bench/packed_step.py                  # S1, 4 rounds (~4 min on 2 cores)
    .venv/bin/python bench/packed_step.py --rounds 6 --steps 20 --size S2

Each variant runs in its own process (``--worker VARIANT``), the order of the variants
alternating between rounds; every worker times steps 2..N of the same jitted
``make_train_step`` (AdamW) of the same jaxtrain Llama on the same tokens:

- ``unpacked``: one document per row (no segment ids, default positions: ``is_causal`` only);
- ``packed``: the same tokens cut into documents of 20-200 tokens, with ``segment_ids`` and
  per-document ``positions`` (the library's attention: one causal segment mask);
- ``packed_two_masks``: as ``packed`` but with the attention of before issue 12 (a dense
  segment mask next to ``is_causal=True``), patched in for the comparison.

Prints the median step time per variant and the median of per-round ratios to ``unpacked``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np

SIZES = {  # hidden, intermediate, layers, heads, seq, batch (bench/overhead.py S1 / S2)
    "S1": (256, 1024, 4, 4, 256, 8),
    "S2": (512, 2048, 8, 8, 512, 4),
}
VARIANTS = ("unpacked", "packed", "packed_two_masks")


def packed_layout(batch: int, seq: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """segment_ids and positions of rows cut into documents of 20-200 tokens."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, seq), np.int32)
    pos = np.zeros((batch, seq), np.int32)
    for r in range(batch):
        at, s = 0, 1
        while at < seq:
            n = min(int(rng.integers(20, 200)), seq - at)
            seg[r, at : at + n], pos[r, at : at + n] = s, np.arange(n)
            at, s = at + n, s + 1
    return seg, pos


def two_masks_attention(q, k, v, *, segment_ids=None, sliding_window=None, implementation=None):
    import jax

    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, :, :]
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, local_window_size=window,
        implementation=implementation,
    )  # fmt: skip


def worker(variant: str, size: str, steps: int) -> dict:
    import jax
    import optax
    from flax import nnx

    import jaxtrain.models.layers as layers
    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.state import TrainState
    from jaxtrain.training.step import make_train_step

    if variant == "packed_two_masks":
        layers.causal_attention = two_masks_attention
    hidden, inter, n_layers, heads, seq, batch = SIZES[size]
    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=n_layers, num_attention_heads=heads,
                         num_key_value_heads=heads)  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adamw(3e-4)
    state = TrainState.create(params, optimizer)
    step = jax.jit(
        make_train_step(graphdef=graphdef, rest=rest, optimizer=optimizer,
                        schedule=optax.constant_schedule(3e-4), seed=0),
        donate_argnums=0,
    )  # fmt: skip
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 4096, (1, batch, seq), dtype=np.int32)
    batch_ = {"input_ids": ids, "labels": ids}
    if variant != "unpacked":
        seg, pos = packed_layout(batch, seq)
        batch_ |= {"segment_ids": seg[None], "positions": pos[None]}
    state, _ = step(state, batch_)
    jax.block_until_ready(state)
    times = []
    for _ in range(steps - 1):
        start = time.perf_counter()
        state, metrics = step(state, batch_)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return {"variant": variant, "step_s": statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="S1", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--worker")
    parser.add_argument("--json")
    opts = parser.parse_args()
    if opts.worker:
        print("RESULT " + json.dumps(worker(opts.worker, opts.size, opts.steps)))
        return
    variants = opts.variants.split(",")
    runs: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(opts.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            cmd = [sys.executable, __file__, "--worker", v, "--size", opts.size,
                   "--steps", str(opts.steps)]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            line = next(x for x in out.splitlines() if x.startswith("RESULT "))
            runs[v].append(json.loads(line[7:])["step_s"])
        print(f"round {r + 1}: " + ", ".join(f"{v} {runs[v][-1]:.3f}s" for v in variants))
    base = runs[variants[0]]
    print(f"\n{opts.size}, {opts.rounds} rounds, {opts.steps} steps each")
    print("| variant | step s (median) | runs | vs " + variants[0] + " (median of rounds) |")
    print("| --- | --- | --- | --- |")
    for v in variants:
        ratio = statistics.median(a / b for a, b in zip(runs[v], base))
        spread = " / ".join(f"{x:.3f}" for x in runs[v])
        print(f"| {v} | {statistics.median(runs[v]):.3f} | {spread} | {ratio:.3f}x |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
