"""A command's garbage-collector thresholds (jaxtrain/cli/collector.py) against Python's own.

    python bench/collector.py [--rounds 5]

Two short `jaxtrain train` runs, each in its own process, interleaved per round: a tiny model
for 8 steps from a warm compilation cache (start-up, tracing and a few steps), and the demo
model's first step from an empty one (its compiles too). The baseline is the same command with
THRESHOLDS set to Python's defaults (700, 10, 10) before `main` reads them. Reports each
variant's median CPU and wall seconds with their range, and the median of the paired CPU
differences. The suite's settings: LLVM level 0, no huge pages (tests/conftest.py).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PYTHON_DEFAULTS = (700, 10, 10)
TINY = [
    "--max_steps", "8", "--total_batch_size", "4", "--max_sequence_length", "32",
    "--logging_steps", "4", "--eval_steps", "4", "--max_eval_batches", "2", "--warmup_steps", "2",
    "--data.max_train_bytes", "200000", "--data.vocab_size", "384", "--model.hidden_size", "32",
    "--model.intermediate_size", "64", "--model.num_hidden_layers", "1",
    "--model.num_attention_heads", "2", "--model.num_key_value_heads", "1",
    "--sample.max_new_tokens", "8",
]  # fmt: skip
# The command as `jaxtrain` runs it, its thresholds first replaced for the baseline.
LAUNCH = """
import runpy, sys
import jaxtrain.cli.collector as collector
if sys.argv[1] == "python":
    collector.THRESHOLDS = {defaults}
sys.argv = ["jaxtrain", *sys.argv[2:]]
runpy.run_module("jaxtrain.cli", run_name="__main__")
"""


def run(variant: str, args: list[str], env: dict[str, str], out: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one command in its own process."""
    shutil.rmtree(out, ignore_errors=True)
    code = LAUNCH.format(defaults=PYTHON_DEFAULTS)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, variant, "train", "--output_dir", str(out), *args],
        env=env,
        check=True,
        capture_output=True,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="collector-"))
    env = os.environ | {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2",
        "JAXTRAIN_CACHE": str(work / "cache"),  # its tokenizers, trained in the warm-up
    }
    warm = {**env, "JAX_COMPILATION_CACHE_DIR": str(work / "warm")}
    empty = {**env, "JAX_COMPILATION_CACHE_DIR": str(work / "empty"), "JAXTRAIN_MAX_STEPS": "1"}
    runs = {"tiny, warm cache": (TINY, warm), "demo 1 step, empty cache": ([], empty)}
    for args, run_env in runs.values():  # the tokenizers and the warm cache, untimed
        run("jaxtrain", args, run_env, work / "run")
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(options.rounds):
        for variant in ("python", "jaxtrain"):
            for name, (args, run_env) in runs.items():
                shutil.rmtree(work / "empty", ignore_errors=True)  # empty for every run
                results.setdefault((name, variant), []).append(
                    run(variant, args, run_env, work / "run")
                )
    print(f"{options.rounds} interleaved rounds, load {os.getloadavg()[0]:.2f}")
    for name in runs:
        for variant, label in (("python", f"{PYTHON_DEFAULTS}"), ("jaxtrain", "the command's")):
            cpu = [c for c, _ in results[name, variant]]
            wall = [w for _, w in results[name, variant]]
            print(
                f"  {name:25s} {label:16s} CPU {statistics.median(cpu):6.2f} s "
                f"({min(cpu):.2f}-{max(cpu):.2f})  wall {statistics.median(wall):6.2f} s "
                f"({min(wall):.2f}-{max(wall):.2f})"
            )
        pairs = zip(results[name, "python"], results[name, "jaxtrain"], strict=True)
        saved = [p[0] - j[0] for p, j in pairs]
        print(
            f"  {name:25s} CPU saved per run: median {statistics.median(saved):.2f} s "
            f"({min(saved):.2f} to {max(saved):.2f}), {sum(s > 0 for s in saved)} of "
            f"{len(saved)} pairs"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
