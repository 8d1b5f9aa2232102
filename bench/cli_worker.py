"""The `cli` variant of overhead.py: `jaxtrain train config.yaml`, as a user types it.

    python bench/cli_worker.py --size S1|S2 --steps N --warmup W

Writes the rows of overhead.make_tokens (the other variants' rows, in order) to a jsonl file
and a config of the same model shape and optimizer (seed 0, AdamW at a constant 3e-4, no
weight decay, no clipping, no shuffling, no evaluation, no checkpoint, no report, no progress
bar, the compilation cache off: a cold start like every variant), then starts the CLI in a
process of its own and reads what it logged:

- first step: the CLI's `metrics.jsonl` record of step 1 (its `time`) minus the moment the
  process was started (`logging_steps: 1`, so step 1 has a record);
- setup (imports, data, model, Trainer) ends where the compile starts: the step-0 record's
  time minus its `compile/train_step_s`; compile + step 1 is the rest of the first step;
- tokens/s: (N - W) * batch * seq over the time between the records of steps W and N (the
  CLI reads each step's metrics back: the loop still dispatches step n + 1 first);
- peak RSS: the child's ru_maxrss (RUSAGE_CHILDREN: the largest child, here the only one).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import (  # noqa: E402 - bench/ is not a package
    LEARNING_RATE,
    RESULT_PREFIX,
    SEED,
    SIZES,
    cpu_sample,
    make_tokens,
)


def config_yaml(shape, data: Path, out: Path, steps: int) -> str:
    return f"""output_dir: {out}
overwrite_output_dir: true
seed: {SEED}
learning_rate: {LEARNING_RATE}
optimizer: adamw
scheduler: constant
weight_decay: 0.0
clip_grad: null
max_steps: {steps}
total_batch_size: {shape.batch}
max_sequence_length: {shape.seq}
logging_steps: 1
evaluation_strategy: "no"
save_final: false
progress_bar: none
run_report: false
shuffle_train: false
compilation_cache_dir: null
model:
  vocab_size: {shape.vocab}
  hidden_size: {shape.hidden}
  intermediate_size: {shape.intermediate}
  num_hidden_layers: {shape.layers}
  num_attention_heads: {shape.heads}
  rms_norm_eps: {shape.eps}
  rope_theta: {shape.rope_theta}
  initializer_range: {shape.init_std}
data:
  source: files
  train_files: {data}
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", required=True, choices=sorted(SIZES))
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    args = p.parse_args()
    shape = SIZES[args.size]
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-cli-") as tmp:
        data, out, config = Path(tmp, "rows.jsonl"), Path(tmp, "run"), Path(tmp, "run.yaml")
        rows = make_tokens(shape, args.steps)
        data.write_text("".join(json.dumps({"input_ids": r.tolist()}) + "\n" for r in rows))
        config.write_text(config_yaml(shape, data, out, args.steps))
        jaxtrain = Path(sys.executable).with_name("jaxtrain")
        before = cpu_sample()
        launch = time.time()
        proc = subprocess.run([str(jaxtrain), "train", str(config)], capture_output=True, text=True)
        busy_end, steal_end, _ = cpu_sample()
        if proc.returncode:
            sys.exit(f"jaxtrain train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records if "loss" in r}
    compiled = next(r for r in records if "compile/train_step_s" in r)
    first = by_step[1]["time"] - launch
    setup = compiled["time"] - compiled["compile/train_step_s"] - launch
    seconds = by_step[args.steps]["time"] - by_step[args.warmup]["time"]
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.time() - launch
    capacity = wall * (os.cpu_count() or 1) / 100
    result = {
        "variant": "cli",
        "size": args.size,
        "steps": args.steps,
        "warmup": args.warmup,
        "first_step_s": first,
        "imports_s": float("nan"),  # not separable from outside the process
        "setup_s": setup,
        "compile_first_step_s": first - setup,
        "steady_s": seconds,
        "tokens_per_s": (args.steps - args.warmup) * shape.batch * shape.seq / seconds,
        "other_cpu_pct": max(busy_end - before[0] - child.ru_utime - child.ru_stime, 0) / capacity,
        "steal_pct": (steal_end - before[1]) / capacity,
        "losses": [by_step[s]["loss"] for s in sorted(by_step)],
        "compile_s": compiled["compile/train_step_s"],
        "peak_rss_mb": child.ru_maxrss / 1024,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
