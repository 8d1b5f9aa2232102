"""Decoder layers under scan (models/layer_scan.py) against the loop: compile time and speed.

    python bench/scan_layers.py [--rounds 3] [--sizes S1,S2] [--repeats 3] [--json P]
    python bench/scan_layers.py --skip-steady     # the compile comparison only

Every variant runs in its OWN process (`--worker`): jaxtrain's LlamaForCausalLM with
`scan_layers` on or off, one jitted AdamW step (bench/overhead.py's "bare" loop: value_and_grad
+ optax adamw, state donated) on random tokens.
- compile: S1's shape (hidden 256, intermediate 1024, 8 x 256 tokens, vocab 4096) at 4 and at
  32 layers, scanned and looped: "trace + lower" (jax.jit(...).lower: Python tracing and
  StableHLO), "XLA compile" (.compile()) and "compile + step 1" (from the step's lowering to
  its first result: both, plus one step, which alone is ~8x longer at 32 layers). Rounds are interleaved
  (each round runs the four variants, in an order rotated per round); the table gives the
  median and the range over rounds, and the 32-layer / 4-layer ratio of the medians.
- steady: tokens/s of the anchor shapes S1 (4 layers) and S2 (8 layers) of overhead.py over
  steps W+1..N, scanned and looped in alternating order; "paired" is the median over repeats
  of scanned / looped of the same repeat (adjacent in time, so slow drifts cancel).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import DEFAULT_STEPS, RESULT_PREFIX, SEED, SIZES, StepClock, make_tokens  # noqa: E402
from overhead import adamw, jaxtrain_config  # noqa: E402

COMPILE_LAYERS = (4, 32)
COMPILE_STEPS, COMPILE_WARMUP = 3, 2  # only step 1 matters; 2 more keep StepClock whole


def worker(size: str, layers: int, scan: bool, steps: int, warmup: int) -> None:
    start = psutil.Process().create_time()
    shape = dataclasses.replace(SIZES[size], layers=layers)
    clock = StepClock(start, warmup, steps)
    from flax import nnx

    from jaxtrain.models import LlamaForCausalLM
    from jaxtrain.training.step import causal_lm_sums

    clock.mark("imports_s")
    model = LlamaForCausalLM(jaxtrain_config(shape), rngs=nnx.Rngs(SEED))
    assert hasattr(model, "scan_layers"), "this jaxtrain has no layer scan (PYTHONPATH?)"
    model.scan_layers = scan
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, input_ids):
        logits = nnx.merge(graphdef, params, rest)(input_ids)
        sums = causal_lm_sums(logits, input_ids)
        return sums["loss_sum"] / sums["tokens"]

    result = timed_loop(loss_fn, params, make_tokens(shape, steps), shape, clock)
    result.update(
        size=size, layers=layers, scan=scan,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )  # fmt: skip
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def timed_loop(loss_fn, params, tokens: np.ndarray, shape, clock: StepClock) -> dict:
    """overhead.py's bare loop, with the step traced, lowered and compiled apart (timed)."""
    import jax
    import optax

    tx = adamw()

    def train_step(state, input_ids):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, input_ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    state = (params, tx.init(params))
    clock.mark("ready_s")
    batch = lambda step: tokens[step * shape.batch : (step + 1) * shape.batch]  # noqa: E731
    t0 = time.perf_counter()
    lowered = jax.jit(train_step, donate_argnums=0).lower(state, batch(0))
    t1 = time.perf_counter()
    step_fn = lowered.compile()
    t2 = time.perf_counter()
    for step in range(clock.steps):
        state, loss = step_fn(state, batch(step))
        clock.after_step(step + 1, state, loss)
    summary = clock.summary(shape)
    return {
        **summary,
        "trace_lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "trace_lower_compile_s": t2 - t0,
    }


def run_worker(size: str, layers: int, scan: bool, steps: int, warmup: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--size", size, "--layers", str(layers),
           "--scan", str(int(scan)), "--steps", str(steps), "--warmup", str(warmup)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        sys.exit(f"worker failed: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    print(
        f"  {size} {layers:>2} layers scan={int(scan)}: trace + lower "
        f"{result['trace_lower_s']:.2f} s, compile {result['compile_s']:.2f} s, compile + step 1 "
        f"{result['compile_first_step_s']:.2f} s, {result['tokens_per_s']:.0f} tokens/s, "
        f"RSS {result['peak_rss_mb']:.0f} MB, other CPU {result['other_cpu_pct']:.1f}%",
        flush=True,
    )
    return result


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def compile_rounds(rounds: int) -> dict:
    variants = [(layers, scan) for layers in COMPILE_LAYERS for scan in (False, True)]
    runs: dict[tuple[int, bool], list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        print(f"compile round {r + 1}/{rounds}", flush=True)
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for layers, scan in order:
            result = run_worker("S1", layers, scan, COMPILE_STEPS, COMPILE_WARMUP)
            runs[(layers, scan)].append(result)
    print("\n| layers | scan | trace + lower s | XLA compile s | compile + step 1 s | peak RSS MB "
          "| final loss |\n|---|---|---|---|---|---|---|")  # fmt: skip
    medians = {}
    for layers, scan in variants:
        rs = runs[(layers, scan)]
        times = [x["compile_first_step_s"] for x in rs]
        medians[(layers, scan)] = statistics.median(times)
        rss = statistics.median(x["peak_rss_mb"] for x in rs)
        lower = spread([x["trace_lower_s"] for x in rs])
        xla = spread([x["compile_s"] for x in rs])
        print(f"| {layers} | {'on' if scan else 'off'} | {lower} | {xla} | {spread(times)} | "
              f"{rss:.0f} | {rs[0]['losses'][-1]:.4f} |")  # fmt: skip
    ratios = {}
    for scan in (False, True):
        for key in ("trace_lower_compile_s", "compile_first_step_s"):
            deep = [x[key] for x in runs[(32, scan)]]
            shallow = [x[key] for x in runs[(4, scan)]]
            ratio = statistics.median(deep) / statistics.median(shallow)
            ratios[f"{key}_{int(scan)}"] = ratio
            per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(deep, shallow))
            print(f"32 / 4 layers, scan {'on' if scan else 'off'}, {key}: {ratio:.2f}x of the "
                  f"medians (per round {per_round})")  # fmt: skip
    return {"runs": {f"{k[0]}_{int(k[1])}": v for k, v in runs.items()}, "ratios": ratios}


def steady(sizes: list[str], repeats: int, warmup: int) -> dict:
    out = {}
    for size in sizes:
        layers, steps = SIZES[size].layers, DEFAULT_STEPS[size]
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for r in range(repeats):
            print(f"steady {size} repeat {r + 1}/{repeats}", flush=True)
            for scan in (r % 2 == 0, r % 2 == 1):
                runs[scan].append(run_worker(size, layers, scan, steps, warmup))
        tps = {s: [x["tokens_per_s"] for x in runs[s]] for s in runs}
        paired = [a / b for a, b in zip(tps[True], tps[False])]
        loss_gap = abs(runs[True][0]["losses"][-1] - runs[False][0]["losses"][-1])
        print(f"\n{size}: tokens/s loop {statistics.median(tps[False]):.0f} "
              f"({' / '.join(f'{x:.0f}' for x in tps[False])}), scan "
              f"{statistics.median(tps[True]):.0f} ({' / '.join(f'{x:.0f}' for x in tps[True])}); "
              f"scan / loop paired median {statistics.median(paired):.3f} "
              f"({', '.join(f'{x:.3f}' for x in paired)}); final losses differ by {loss_gap:.1e}; "
              f"peak RSS loop {max(x['peak_rss_mb'] for x in runs[False]):.0f} MB, scan "
              f"{max(x['peak_rss_mb'] for x in runs[True]):.0f} MB")  # fmt: skip
        out[size] = {"runs": {str(k): v for k, v in runs.items()}, "paired": paired}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="interleaved compile rounds")
    p.add_argument("--sizes", default="S1,S2", help="anchor shapes for tokens/s")
    p.add_argument("--repeats", type=int, default=3, help="tokens/s repeats per size")
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from tokens/s")
    p.add_argument("--skip-steady", action="store_true", help="compile comparison only")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", default="S1", help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--scan", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.size, args.layers, bool(args.scan), args.steps, args.warmup)
        return
    results = {"compile": compile_rounds(args.rounds)}
    if not args.skip_steady:
        results["steady"] = steady(args.sizes.split(","), args.repeats, args.warmup)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
