"""Muon against AdamW on the demo: steps to AdamW's final eval loss, and step time.

    .venv/bin/python bench/muon.py                          # 3 seeds, the demo's 600 steps
    .venv/bin/python bench/muon.py --seeds 0 --max_steps 40 # a quick look

Each run is `jaxtrain train` (the demo: 1.3M-parameter Llama on the embedded stdlib corpus,
cosine schedule with 30 warmup steps, weight decay 0.1) with `--optimizer adamw` or
`--optimizer muon --momentum 0.95` at the demo's learning rate (3e-3: Muon's updates are
scaled to AdamW's RMS, so one learning rate serves both), evaluated every `--eval_steps`
steps on the same 16 eval batches. For each seed: AdamW's final eval loss is the target, and
Muon's steps to reach it are read off its eval curve (linear between two evaluations);
the ratio to AdamW's steps is the figure (the issue's target: <= 0.85). Runs one after the
other, in subprocesses; the step times they log move with the machine's load, so
`--step_time` times the two compiled train steps of the demo's model and batch shape in one
process instead, interleaved (the order alternates every round), and prints their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, optimizer: str, seed: int, args) -> list[dict]:
    flags = ["--optimizer", optimizer, "--seed", str(seed), "--output_dir", str(out)]
    flags += ["--max_steps", str(args.max_steps), "--eval_steps", str(args.eval_steps)]
    flags += ["--progress_bar", "none", "--run_report", "false", "--save_final", "false"]
    if optimizer == "muon":
        flags += ["--momentum", str(args.momentum)]
    if args.learning_rate:
        flags += ["--learning_rate", str(args.learning_rate)]
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    jaxtrain = Path(sys.executable).with_name("jaxtrain")
    done = subprocess.run(
        [str(jaxtrain), "train", *flags], env=env, capture_output=True, text=True, cwd=out.parent
    )
    if done.returncode != 0:
        raise SystemExit(f"{optimizer} seed {seed} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steps_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """The first step at which the eval curve reaches `target` (linear between evals)."""
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return s1 if l0 == l1 else s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
    return None


def step_times(rounds: int, steps: int) -> None:
    """The demo model's train step with AdamW and with Muon, timed in interleaved rounds."""
    import time

    import jax
    import numpy as np
    from flax import nnx

    from jaxtrain import TrainingArguments
    from jaxtrain.cli.run_config import DEFAULT_CONFIG
    from jaxtrain.config.sections import RunSettings
    from jaxtrain.models import LlamaConfig, LlamaForCausalLM
    from jaxtrain.runtime import Runtime
    from jaxtrain.training.program import ModelParts, Program

    model = DEFAULT_CONFIG["model"]
    vocab, rows, seq = DEFAULT_CONFIG["data"]["vocab_size"], 16, 256
    config = LlamaConfig(vocab_size=vocab, **model)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (1, rows, seq)).astype(np.int32)
    batch = {"input_ids": jax.numpy.asarray(ids), "labels": jax.numpy.asarray(ids)}
    runs = {}
    for optimizer in ("adamw", "muon"):
        args = TrainingArguments(
            output_dir=tempfile.mkdtemp(), optimizer=optimizer, learning_rate=3e-3,
            weight_decay=0.1, momentum=0.95, max_sequence_length=seq, total_batch_size=rows,
        )  # fmt: skip
        runtime = Runtime.from_arguments(args, jax.devices()[:1])
        parts = ModelParts.adopt(
            LlamaForCausalLM(config, rngs=nnx.Rngs(0)), RunSettings.from_arguments(args).model
        )
        program = Program(parts, runtime, RunSettings.from_arguments(args), schedule_length=600)
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
        runs[optimizer] = [program.compile_train_step(program.abstract_state(), abstract),
                           program.create_state()]  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[r % 2 :] + list(runs)[: r % 2]:
            step, state = runs[name]
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - start) / steps)
            runs[name][1] = state
    adamw, muon = (statistics.median(times[n]) for n in ("adamw", "muon"))
    print(f"step time ({rounds} rounds x {steps} steps): AdamW {adamw * 1e3:.1f} ms, Muon "
          f"{muon * 1e3:.1f} ms ({muon / adamw:.2f}x; per-round ratios "
          f"{', '.join(f'{m / a:.2f}' for a, m in zip(times['adamw'], times['muon']))})")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max_steps", type=int, default=600)
    parser.add_argument("--eval_steps", type=int, default=30)
    parser.add_argument("--momentum", type=float, default=0.95)
    parser.add_argument("--learning_rate", type=float, default=None)
    parser.add_argument("--step_time", action="store_true", help="time the two steps only")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if args.step_time:
        step_times(args.rounds, steps=5)
        return 0
    root = Path(tempfile.mkdtemp(prefix="bench_muon_"))
    rows = []
    for seed in args.seeds:
        result = {}
        for optimizer in ("adamw", "muon"):
            logs = run(root / f"{optimizer}_{seed}", optimizer, seed, args)
            curve = [(e["step"], e["eval/loss"]) for e in logs if "eval/loss" in e]
            times = [e["step_time_s"] for e in logs if "step_time_s" in e][1:]
            result[optimizer] = {"curve": curve, "step_s": statistics.median(times)}
        target_step, target = result["adamw"]["curve"][-1]
        reached = steps_to(result["muon"]["curve"], target)
        rows.append((seed, target, target_step, reached, result))
        print(
            f"seed {seed}: AdamW final eval loss {target:.4f} at step {target_step}; Muon "
            f"reaches it at step {reached if reached is None else round(reached)} "
            f"({'-' if reached is None else f'{reached / target_step:.2f}x'}); final "
            f"{result['muon']['curve'][-1][1]:.4f}; step "
            f"{result['adamw']['step_s'] * 1e3:.1f} ms (AdamW) / "
            f"{result['muon']['step_s'] * 1e3:.1f} ms (Muon)",
            flush=True,
        )
    ratios = [r[3] / r[2] for r in rows if r[3] is not None]
    if ratios:
        print(
            f"steps to AdamW's final loss: mean {statistics.mean(ratios):.2f}x over {len(ratios)} seeds"
        )
    step = [r[4]["muon"]["step_s"] / r[4]["adamw"]["step_s"] for r in rows]
    print(f"step time Muon / AdamW: median {statistics.median(step):.2f}x")
    print(f"runs in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
