"""Long rows: dense vs blockwise attention (models/blockwise.py), packed rows, ring attention.

    .venv/bin/python bench/long_context.py                    # ~15 minutes on 2 cores
    .venv/bin/python bench/long_context.py --sizes 1024,2048 --skip-packed --skip-sp
    .venv/bin/python bench/long_context.py --sizes "" --skip-packed --skip-sp   # padded rows

A small Llama (hidden 256, 4 layers, 8 heads of 32, vocab 32000, full remat
``nothing_saveable``, batch 1, float32) takes SGD steps of the Trainer's loss
(``causal_lm_loss_sums``: the logits are chunked at long rows) on random tokens. Each
measurement runs in its own process (``--worker``) and reports the median time of the steps
after the first (compile) and the process's peak RSS (``ru_maxrss``: it includes jax itself
and compilation).

- ``dense`` vs ``blockwise`` at every size of ``--sizes``; a variant stops growing once a
  step took over 30 s (the next size would take over ~2 minutes) or when the dense scores
  (DENSE_SCORE_COPIES x [8, T, T] float32, measured) would pass 16 GB; blockwise
  still runs the largest size, one step including its compilation (``first_step_s``);
- packed rows of 16 documents (4k and 8k): dense with its [T, T] segment mask vs blockwise,
  which skips the blocks of other documents (dense at 8k is skipped by the memory rule);
- sp = 4 on 4 simulated CPU devices vs sp = 1: XLA's temp buffer size per device of the
  compiled train step (``memory_analysis``) at 8k, ring attention over the sp axis;
- padded rows (4k and 8k, an eighth of each row real, blockwise): the batch's
  ``attention_mask`` marking the padding (the loss then skips its blocks) vs the same batch
  without it (every block of the causal triangle computed), in interleaved rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
MAX_STEP_S = 30.0
MAX_DENSE_BYTES = 16e9
# Peak RSS of the dense step in [8, T, T] float32 score arrays: 6754 MB at 4k = 12.6 of them
# (2026-11-25). At 8k that is ~27 GB: the process was killed on a 24 GB machine.
DENSE_SCORE_COPIES = 12.6
HEADS = 8


def dense_bytes(seq: int) -> float:
    return DENSE_SCORE_COPIES * HEADS * seq * seq * 4


def build(seq: int, implementation: str):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.training.step import causal_lm_loss_sums

    config = LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=HEADS, max_position_embeddings=max(seq, 2048),
    )  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    model.remat_policy = "nothing_saveable"
    model.attention_implementation = implementation
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def step(params, batch):
        def loss(params):
            sums = causal_lm_loss_sums(nnx.merge(graphdef, params, rest), batch, None)
            return sums["loss_sum"] / sums["tokens"]

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads), value

    return step, params, jnp


PADDED_REAL_FRACTION = 8  # a padded row's real tokens: seq // 8


def batch_for(seq: int, documents: int, padding: str = ""):
    """`padding`: "" (every token real), "marked" (an eighth real, the rest padding that the
    batch's attention_mask marks) or "unmarked" (the same row without its attention_mask)."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(1, 32000, size=(1, seq)).astype(np.int32)
    batch = {"input_ids": ids, "labels": ids}
    if padding:
        real = np.arange(seq)[None] < seq // PADDED_REAL_FRACTION
        batch = {"input_ids": ids * real, "labels": np.where(real, ids, -100).astype(np.int32)}
        if padding == "marked":
            batch["attention_mask"] = real.astype(np.int32)
    if documents > 1:  # equal documents, positions restart at each
        length = seq // documents
        batch["segment_ids"] = (np.arange(seq) // length + 1)[None].astype(np.int32)
        batch["positions"] = (np.arange(seq) % length)[None].astype(np.int32)
    return batch


def worker_steps(
    seq: int, implementation: str, documents: int, steps: int, padding: str = ""
) -> dict:
    import jax

    step, params, jnp = build(seq, implementation)
    step = jax.jit(step, donate_argnums=0)
    batch = {k: jnp.asarray(v) for k, v in batch_for(seq, documents, padding).items()}
    start = time.perf_counter()
    params, loss = step(params, batch)
    jax.block_until_ready(loss)
    first = time.perf_counter() - start
    times = [first]  # steps=0: only the first step (compile included) is reported
    for _ in range(steps):
        start = time.perf_counter()
        params, loss = step(params, batch)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    times = times[1:] or times
    return {
        "first_step_s": round(first, 2),
        "step_s": round(statistics.median(times), 3),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "loss": float(loss),
    }


def worker_sp(seq: int, sp: int) -> dict:
    """Temp bytes per device of the compiled blockwise train step on a 1 x sp mesh."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxtrain.models.sharding import with_activation_sharding
    from jaxtrain.parallel import ShardingRules, build_mesh

    mesh = build_mesh((1, 1, 1, 1, sp), jax.devices()[:sp])
    rules = ShardingRules(mesh)
    step, params, jnp = build(seq, "blockwise")
    batch = batch_for(seq, 1)
    rows = NamedSharding(mesh, P(None, "sp"))
    batch = {k: jax.device_put(v, rows) for k, v in batch.items()}
    params = jax.device_put(params, NamedSharding(mesh, P()))
    fn = jax.jit(with_activation_sharding(step, rules))
    compiled = fn.lower(params, batch).compile()
    return {"temp_mb_per_device": round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 1)}


def run_worker(*args: str, devices: int = 1) -> dict | None:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, __file__, "--worker", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": "timeout (900 s)"}
    if proc.returncode:
        lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode} (killed: memory?)"]
        return {"error": lines[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--packed-sizes", default="4096,8192")
    parser.add_argument("--skip-packed", action="store_true")
    parser.add_argument("--skip-sp", action="store_true")
    parser.add_argument("--padded-sizes", default="4096,8192")
    parser.add_argument("--skip-padded", action="store_true")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (padded)")
    parser.add_argument("--worker", nargs="+")
    args = parser.parse_args()
    if args.worker:
        kind, *rest = args.worker
        if kind == "sp":
            out = worker_sp(int(rest[0]), int(rest[1]))
        else:
            seq, documents, steps = (int(x) for x in rest[:3])
            out = worker_steps(seq, kind, documents, steps, *rest[3:])
        print(json.dumps(out))
        return
    print(f"load average at start: {os.getloadavg()}", flush=True)
    results: dict[str, dict] = {}
    stopped: dict[str, str] = {}
    sizes = [int(s) for s in args.sizes.split(",") if s]  # "" runs none
    for seq in sizes:
        for impl in ("dense", "blockwise"):
            # The largest blockwise size always runs (one step, compile included): it is the
            # proof that such a row trains, however slowly.
            last = impl == "blockwise" and seq == sizes[-1] and impl in stopped
            if impl in stopped and not last:
                results[f"{impl} {seq}"] = {"skipped": stopped[impl]}
            elif impl == "dense" and dense_bytes(seq) > MAX_DENSE_BYTES:
                results[f"{impl} {seq}"] = {"skipped": "dense scores > 16 GB"}
            else:
                steps = 0 if last else 2 if seq < 16384 else 1
                name = "xla" if impl == "dense" else impl
                out = run_worker(name, str(seq), "1", str(steps))
                results[f"{impl} {seq}"] = out
                if out.get("step_s", 0) > MAX_STEP_S:
                    stopped[impl] = f"{seq} took {out['step_s']} s a step"
            print(f"{impl} {seq}: {results[f'{impl} {seq}']}", flush=True)
    if not args.skip_packed:
        for seq in (int(s) for s in args.packed_sizes.split(",")):
            for impl in ("xla", "blockwise"):
                if impl == "xla" and dense_bytes(seq) > MAX_DENSE_BYTES:
                    out = {"skipped": "dense scores > 16 GB"}
                else:
                    out = run_worker(impl, str(seq), "16", "2")
                results[f"packed {seq} x 16 {impl}"] = out
                print(f"packed {seq} x 16 docs {impl}: {out}", flush=True)
    if not args.skip_sp:
        for sp in (1, 4):
            out = run_worker("sp", "8192", str(sp), devices=sp)
            results[f"sp{sp} 8192"] = out
            print(f"sp={sp} 8192 blockwise: {out}", flush=True)
    if not args.skip_padded:
        for seq in (int(s) for s in args.padded_sizes.split(",")):
            times: dict[str, list[float]] = {"marked": [], "unmarked": []}
            for _ in range(args.rounds):
                for padding in times:
                    out = run_worker("blockwise", str(seq), "1", "2", padding)
                    times[padding].append(out.get("step_s", float("nan")))
                    print(f"padded {seq} {padding}: {out}", flush=True)
            medians = {k: statistics.median(v) for k, v in times.items()}
            results[f"padded {seq}"] = {
                **{f"{k}_step_s": v for k, v in times.items()},
                "unmarked_over_marked": round(medians["unmarked"] / medians["marked"], 2),
            }
            print(f"padded {seq}: {results[f'padded {seq}']}", flush=True)
    print(f"load average at end: {os.getloadavg()}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
