"""The GPU campaign in one command: a ~1B Llama in bf16 at sequence 4096 on one accelerator.

    python bench/accelerator.py [--out DIR] [--budget-s 380] [--stages train,generate,batch,plan]
    python bench/accelerator.py --tiny          # the same stages on a tiny model (CPU, make test)

Every stage runs in its own process (bench/accelerator_stages.py), so a stage that runs out
of memory or crashes costs only itself; the parent keeps a wall-clock budget and skips what no longer
fits, so a session lent a device for minutes gets the most important figures first:

- train/<variant>: the Trainer on random tokens (no padding), AdamW, bf16 compute with fp32
  parameters, for attention "cudnn" (jax.nn.dot_product_attention's fused kernel, no remat),
  "blockwise" (models/blockwise.py, no remat), "xla" (dense einsums; its [B, N, T, T]
  probabilities need remat "dots_saveable" to fit at 4096) and "auto" (no implementation set:
  the default a user gets); `--variants cudnn_cublas` adds cuDNN with XLA's Triton GEMMs off. tokens/s and MFU are the Trainer's
  own logged values over steps W+1..N (its metrics.jsonl), the memory keys those of its
  monitor (track_memory), the compiled step's memory from its run_info.json.
- generate: `jaxtrain.models.generate` (KV cache, greedy) from bf16 parameters: new tokens/s of
  the second call (the first compiles).
- batch: the largest batch that fits, for the first train variant: the GPU compiler's memory
  analysis of the step at two batch sizes (compiled from shapes, nothing allocated), a line
  through them to the device's limit, then real steps at that batch.
- profile: the first variant's steps W+1..N traced with jax.profiler, summed by kernel and
  category (bench/trace_summary.py); the trace stays in DIR/trace.
- plan: `jaxtrain plan --devices 1 --accelerator h100` of the same run (XLA:CPU in a child
  process: it runs beside the GPU stages), its predicted step time and memory next to the
  measured ones.

Writes DIR/accelerator.json and prints a Markdown table for bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from accelerator_stages import MODELS, RESULT_PREFIX, RUNS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# name: (attention implementation, remat policy, extra environment), most wanted first.
# "auto" is attention_implementation=None, the default a user gets.
TRAIN_VARIANTS: dict[str, tuple[str, str, dict[str, str]]] = {
    "cudnn": ("cudnn", "none", {}),
    "blockwise": ("blockwise", "none", {}),
    "xla": ("xla", "dots_saveable", {}),
    "auto": ("auto", "none", {}),
    # Every matmul through cuBLAS instead of XLA's Triton GEMM emitter where it would pick one.
    "cudnn_cublas": ("cudnn", "none", {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}),
}
DEFAULT_VARIANTS = "cudnn,blockwise,xla,auto"
GPU_ONLY = ("cudnn", "cudnn_cublas")
STAGES = ("train", "generate", "batch", "profile", "plan")
# Seconds a stage needs at the least (start, imports, compile); a stage is skipped when less
# of the budget is left. Tiny runs have no minimum.
MIN_STAGE_S = {"train": 60, "generate": 40, "batch": 100, "profile": 60}


def plan_command(size: str, attention: str, remat: str, out: Path) -> list[str]:
    """`jaxtrain plan` of the first train variant's run on one H100."""
    run = RUNS[size]
    hf_config = out / "model_config.json"
    hf_config.write_text(json.dumps({"model_type": "llama", **MODELS[size]}))
    return [
        sys.executable, "-m", "jaxtrain.cli", "plan",
        "--hf_config", str(hf_config), "--devices", "1", "--accelerator", "h100",
        "--output", str(out / "plan.json"),
        "--total_batch_size", str(run["batch"]),
        "--max_sequence_length", str(run["seq"]),
        "--dtype", "bfloat16", "--gradient_checkpointing", remat,
        "--optimizer", "adamw",
        # XLA:CPU beside the GPU stages: the GPU compiler's own plan (planning/targets.py)
        # would open the GPU the training stages are measuring.
        "--compiler", "cpu",
    ] + ([] if attention == "auto" else ["--model.attention_implementation", attention])  # fmt: skip


def read_plan(path: Path) -> dict:
    plan = json.loads(path.read_text())
    entry = plan["meshes"][0]
    figures, est = entry.get("figures", {}), entry.get("estimate", {})
    return {
        # XLA:GPU where the plan's child found the CUDA plugin and the GPU, else XLA:CPU.
        "compiler": (entry.get("compiler") or {}).get("compiler", "XLA:CPU"),
        "peak_bytes": figures.get("peak_bytes"),
        "shape_estimate_bytes": figures.get("shape_estimate_bytes"),
        "estimate": {k: v for k, v in est.items() if not isinstance(v, list)},
    }


def device_line() -> dict:
    """What the parent's environment would run on, read in a child (jax stays out of it)."""
    code = (
        "import jax, json; d = jax.devices()[0]; "
        "print(json.dumps({'platform': d.platform, 'kind': d.device_kind, "
        "'count': jax.device_count(), 'jax': jax.__version__}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}


def run_stage(args: list[str], timeout: float, log: Path, env: dict | None = None) -> dict:
    """One worker process; its result, or what went wrong (the log keeps its output)."""
    command = [sys.executable, str(Path(__file__).with_name("accelerator_stages.py")), *args]
    start = time.perf_counter()
    env = {**os.environ, **(env or {})}
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as err:
        log.write_text(f"{err.stdout or ''}\n{err.stderr or ''}")
        return {"error": f"timed out after {timeout:.0f} s"}
    log.write_text(out.stdout + "\n" + out.stderr)
    seconds = time.perf_counter() - start
    for line in out.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return {**json.loads(line[len(RESULT_PREFIX) :]), "process_s": seconds}
    tail = [x for x in out.stderr.splitlines() if x.strip()][-3:]
    return {"error": f"exit {out.returncode}: " + " | ".join(tail)[-600:], "process_s": seconds}


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}"


def markdown(report: dict) -> list[str]:
    rows = [
        "| variant | remat | batch x seq | tokens/s | TFLOP/s | MFU | step s | compile s | "
        "device peak GiB | compiled peak GiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in report["train"].items():
        if "error" in r:
            rows.append(
                f"| {name} | {TRAIN_VARIANTS[name][1]} | | {r['error'][:160]} | | | | | | |"
            )
            continue
        peak = r["memory"].get("memory/device_peak_gib")
        compiled = (r.get("compiled_memory") or {}).get("peak")
        rows.append(
            f"| {name} | {r['remat']} | {r['batch']} x {r['seq']} | "
            f"{r['tokens_per_second']:,.0f} | {r['tflops_per_device'] or 0:.1f} | "
            f"{100 * (r['mfu'] or 0):.1f}% | {r['step_time_s']:.3f} | {r['compile_s'] or 0:.1f} | "
            f"{'-' if peak is None else f'{peak:.1f}'} | {gib(compiled)} |"
        )
    gen = report.get("generate") or {}
    if "new_tokens_per_second" in gen:
        rows.append(
            f"\ngeneration: {gen['batch']} rows x {gen['new_tokens_per_row']} new tokens after "
            f"{gen['prompt']}-token prompts: {gen['new_tokens_per_second']:,.0f} new tokens/s "
            f"(first call {gen['first_call_s']:.1f} s, compile included)"
        )
    batch = report.get("batch") or {}
    if "predicted" in batch:
        largest = batch.get("largest") or {}
        rows.append(
            f"largest batch ({batch['attention']}, remat {batch['remat']}): predicted "
            f"{batch['predicted']} rows from the compiled peak "
            f"({gib(batch['per_row_bytes'])} GiB per row, limit {gib(batch['limit_bytes'])} GiB); "
            f"tried {batch['tried']}"
            + (
                f"; {largest['tokens_per_second']:,.0f} tokens/s, MFU "
                f"{100 * (largest['mfu'] or 0):.1f}%"
                if largest
                else ""
            )
        )
    profile = (report.get("profile") or {}).get("trace")
    if profile:
        from trace_summary import lines

        rows += ["", f"profile of steps {report['profile']['window_steps']}:", *lines(profile)]
    plan = report.get("plan") or {}
    if "estimate" in plan:
        est = plan["estimate"]
        rows.append(
            f"jaxtrain plan ({plan.get('compiler', 'XLA:CPU')} compile): peak "
            f"{gib(plan['peak_bytes'])} GiB, by shapes "
            f"{gib(plan['shape_estimate_bytes'])} GiB; compute {est.get('compute_s', 0):.3f} s, "
            f"memory {est.get('memory_s', 0):.3f} s per step"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/accelerator")
    parser.add_argument("--budget-s", type=float, default=380.0)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--tiny", action="store_true", help="the tiny model (CPU, for tests)")
    opts = parser.parse_args(argv)
    size = "tiny" if opts.tiny else "1b"
    stages = [s for s in opts.stages.split(",") if s]
    variants = [v for v in opts.variants.split(",") if v]
    for name in stages:
        if name not in STAGES:
            parser.error(f"--stages: unknown stage {name!r}; choose from {', '.join(STAGES)}")
    for name in variants:
        if name not in TRAIN_VARIANTS:
            parser.error(f"--variants: unknown {name!r}; choose from {', '.join(TRAIN_VARIANTS)}")
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + opts.budget_s
    device = device_line()
    if device.get("platform") == "cpu":  # the fused kernel exists on NVIDIA GPUs only
        variants = [v for v in variants if v not in GPU_ONLY]
    report: dict = {"size": size, "model": MODELS[size], "run": RUNS[size], "device": device}
    report["train"] = {}
    print(f"accelerator campaign on {device}: stages {stages}, variants {variants}", flush=True)
    first = variants[0] if variants else "blockwise"
    attention, remat, first_env = TRAIN_VARIANTS[first]
    plan_proc = None
    if "plan" in stages:  # XLA:CPU in the background, beside the GPU stages
        plan_log = open(out / "plan.log", "w")  # noqa: SIM115 - closed after wait()
        command = plan_command(size, attention, remat, out)
        plan_proc = subprocess.Popen(command, stdout=plan_log, stderr=subprocess.STDOUT)
    tiny = ["--size", size]

    def left(stage: str) -> float | None:
        """Seconds this stage may take, or None to skip it."""
        remaining = deadline - time.perf_counter()
        return remaining if opts.tiny or remaining >= MIN_STAGE_S[stage] else None

    def record(key: str, result: dict) -> None:
        print(f"{key}: {json.dumps(result)[:400]}", flush=True)
        (out / "accelerator.json").write_text(json.dumps(report, indent=2) + "\n")

    if "train" in stages:
        for name in variants:
            budget = left("train")
            impl, policy, env = TRAIN_VARIANTS[name]
            args = ["train", *tiny, "--attention", impl, "--remat", policy]
            result = (
                {"error": "skipped: the budget ran out"}
                if budget is None
                else run_stage(args, budget, out / f"train-{name}.log", env)
            )
            report["train"][name] = result
            record(f"train/{name}", result)
    if "generate" in stages:
        budget = left("generate")
        result = (
            {"error": "skipped: the budget ran out"}
            if budget is None
            else run_stage(["generate", *tiny], budget, out / "generate.log")
        )
        report["generate"] = result
        record("generate", result)
    if "batch" in stages:
        budget = left("batch")
        args = ["batch", *tiny, "--attention", attention, "--remat", remat]
        result = (
            {"error": "skipped: the budget ran out"}
            if budget is None
            else run_stage(args, budget, out / "batch.log", first_env)
        )
        report["batch"] = result
        record("batch", result)
    if "profile" in stages:
        budget = left("profile")
        args = ["profile", *tiny, "--attention", attention, "--remat", remat]
        args += ["--trace-dir", str(out / "trace")]
        result = (
            {"error": "skipped: the budget ran out"}
            if budget is None
            else run_stage(args, budget, out / "profile.log", first_env)
        )
        report["profile"] = result
        record("profile", result)
    if plan_proc is not None:
        try:
            plan_proc.wait(timeout=max(deadline - time.perf_counter(), 5))
            report["plan"] = (
                read_plan(out / "plan.json")
                if plan_proc.returncode == 0
                else {"error": f"jaxtrain plan exited {plan_proc.returncode} (plan.log)"}
            )
        except subprocess.TimeoutExpired:
            plan_proc.kill()
            report["plan"] = {"error": "jaxtrain plan did not finish inside the budget"}
        plan_log.close()
        record("plan", report["plan"])
    table = markdown(report)
    (out / "accelerator.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    failed = [k for k, v in report["train"].items() if "error" in v]
    return 1 if failed and len(failed) == len(report["train"]) else 0


if __name__ == "__main__":
    sys.exit(main())
