"""The GPU campaign in one command: a ~1B Llama in bf16 at sequence 4096 on one accelerator.

    python bench/accelerator.py [--out DIR] [--budget-s 380] [--stages train,generate,batch,plan]
    python bench/accelerator.py --tiny          # the same stages on a tiny model (CPU, make test)

Every stage runs in its own process (bench/accelerator_stages.py), so a stage that runs out
of memory or crashes costs only itself; the parent keeps a wall-clock budget and skips what no longer
fits, so a session lent a device for minutes gets the most important figures first:

- train/<variant>: the Trainer on random tokens (no padding), AdamW, bf16 compute with fp32
  parameters, for attention "cudnn" (jax.nn.dot_product_attention's fused kernel, no remat),
  "blockwise" (models/blockwise.py), "xla" (dense einsums; its [B, N, T, T] probabilities need
  remat "dots_saveable" to fit at 4096), "auto" (no implementation set: the default a user
  gets), "fp8", "bf16_moments", "scan" and "fused" ("auto" with fp8_matmuls, with mu_dtype
  bfloat16, with scan_layers, with elementwise_kernels "pallas") and
  "cudnn_cublas" (XLA's Triton GEMMs off). tokens/s and MFU are the Trainer's own logged
  values over steps W+1..N (its metrics.jsonl), the memory keys those of its monitor
  (track_memory), the compiled step's memory from its run_info.json.
- profile: the first variant's steps W+1..N traced with jax.profiler, summed by kernel and
  category (bench/trace_summary.py); the trace stays in DIR/trace.
- engine: the serving engine (paged KV pool, greedy, bf16) on generate's prompts, its pages
  read by the gather path and (GPU or TPU) by JAX's Pallas paged-attention kernel, and with 8
  decode steps per call: new tokens/s of a timed call, how many tokens the two kernels
  agree on, and the first token's latency alone and with 8 prompts submitted together.
- generate: `jaxtrain.models.generate` (KV cache, greedy) from bf16 parameters: new tokens/s of
  the second call (the first compiles).
- plan: `jaxtrain plan --devices 1` of the first variant's run, its predicted step time and
  memory next to the measured ones. On a GPU, after the train stages, with the GPU's own
  compiler (deviceless, for the accelerator the device's name gives: the check of the plan's
  memory against a run); elsewhere XLA:CPU in a child process beside the other stages.
- batch: the largest batch that fits, for the first train variant: the GPU compiler's memory
  analysis of the step at two batch sizes (compiled from shapes, nothing allocated), a line
  through them to the device's limit, then real steps at that batch.
- moe: the model's mixture-of-experts twin (8 experts of half the MLP width, top-2: the dense
  model's active MLP) trained as train/<first variant> is, once per expert dispatch:
  `jax.lax.ragged_dot` and the Pallas kernels (models/moe_kernels.py): tokens/s, MFU against
  the dense step's, and the losses side by side.
- gmm: one grouped matmul of the MoE twin's layer (bf16, uneven groups) by `ragged_dot`, by
  our Pallas kernel and (Hopper) by JAX's Mosaic-GPU example kernel: ms and TFLOP/s each.
- grpo: GRPO (full fine-tuning, bf16 compute, the engine sampling, random prompts and a
  word-level tokenizer: nothing to download) synchronous, with max_staleness 1, and
  synchronous with 8 decode steps per engine call (`rollout_decode_steps`): seconds per step
  over the steady steps, the ratios to the synchronous run (issue 47's figure; whether 8
  steps a call, 1.70x the engine's tokens/s on an H200, pays in a GRPO step), the weight
  handoff. Each step's timings go to its log as it ends.

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

# name: (attention implementation, remat policy, extra environment, TrainingArguments
# overrides), most wanted first. "auto" is attention_implementation=None, the default a user
# gets.
TRAIN_VARIANTS: dict[str, tuple[str, str, dict[str, str], dict]] = {
    "cudnn": ("cudnn", "none", {}, {}),
    # The default attention (cuDNN's on an NVIDIA GPU) with AdamW's first moment in bf16 (less
    # of the update's memory traffic), and with the decoder layers under one scan.
    "bf16_moments": ("auto", "none", {}, {"mu_dtype": "bfloat16"}),
    "scan": ("auto", "none", {}, {"scan_layers": True}),
    # The decoder layers' projections in float8 (models/fp8.py): issue 49's >= 1.15x bar.
    "fp8": ("auto", "none", {}, {"fp8_matmuls": True}),
    "blockwise": ("blockwise", "none", {}, {}),
    "xla": ("xla", "dots_saveable", {}, {}),
    "auto": ("auto", "none", {}, {}),
    # The layers' elementwise work as fused Pallas (Triton) kernels (models/elementwise.py):
    # issue 49's elementwise share of device time, against "auto".
    "fused": ("auto", "none", {}, {"elementwise_kernels": "pallas"}),
    # Every matmul through cuBLAS instead of XLA's Triton GEMM emitter where it would pick one.
    "cudnn_cublas": ("cudnn", "none", {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}, {}),
}
DEFAULT_VARIANTS = "cudnn,fp8,bf16_moments,scan,fused"
GPU_ONLY = ("cudnn", "cudnn_cublas", "fused")  # kernels that exist on NVIDIA GPUs only
STAGES = ("train", "profile", "engine", "generate", "plan", "batch", "moe", "gmm", "grpo")
# The grpo stage: GRPO on the size's random model: name -> (max_staleness, decode steps per
# engine call).
GRPO_VARIANTS = {"sync": (0, 1), "async": (1, 1), "steps8": (0, 8)}
# The moe stage: the size's MoE twin (8 experts, top-2, the dense MLP's active width) trained
# with each expert dispatch; on a CPU (the tiny dry run) the blocked loop and the GPU kernel's
# code interpreted stand in for ragged_dot and the kernel.
MOE_VARIANTS = {"gpu": ("ragged_dot", "pallas"), "tpu": ("ragged_dot", "pallas"),
                "cpu": ("blocks", "interpret")}  # fmt: skip
# The engine stage's variants: name -> (how it reads its KV pages, decode steps per call).
# "pallas" (JAX's Pallas kernel) runs on a GPU or TPU only.
ENGINE_VARIANTS = {"gather": ("gather", 1), "pallas": ("pallas", 1), "steps8": ("gather", 8)}
ENGINE_ATTENTION = ("gather", "pallas")  # the two engine_agreement compares
# Seconds a stage needs at the least (start, imports, compile); a stage is skipped when less
# of the budget is left. Tiny runs have no minimum. A grpo variant compiles the train step,
# the policy's log-probs and the engine's buckets before its first step: on an H200 the sync
# variant took 226 s in all, steps8 319 s (bench/RESULTS.md, 2026-12-04, session 56).
MIN_STAGE_S = {"train": 60, "generate": 40, "engine": 40, "batch": 100, "profile": 60, "plan": 40,
               "moe": 90, "gmm": 40, "grpo": 300}  # fmt: skip


def plan_command(
    size: str, attention: str, remat: str, out: Path, accelerator: str, compiler: str
) -> list[str]:
    """`jaxtrain plan` of the first train variant's run on one `accelerator`."""
    run = RUNS[size]
    hf_config = out / "model_config.json"
    hf_config.write_text(json.dumps({"model_type": "llama", **MODELS[size]}))
    return [
        sys.executable, "-m", "jaxtrain.cli", "plan",
        "--hf_config", str(hf_config), "--devices", "1", "--accelerator", accelerator,
        "--output", str(out / "plan.json"),
        "--total_batch_size", str(run["batch"]),
        "--max_sequence_length", str(run["seq"]),
        "--dtype", "bfloat16", "--gradient_checkpointing", remat,
        "--optimizer", "adamw", "--compiler", compiler,
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


def engine_agreement(out: Path) -> dict:
    """How far the Pallas kernel's greedy tokens follow the gather path's (bf16 on random
    weights: a near-tie flips a token, and the rows part from there), and how close the two
    log-probs are over the tokens both drew from the same context."""
    paths = {k: out / f"engine-{k}.npz" for k in ENGINE_ATTENTION}
    if not all(p.exists() for p in paths.values()):
        return {"error": "needs both engine runs' tokens"}
    import numpy as np

    gather, pallas = (np.load(p) for p in paths.values())
    same = gather["tokens"] == pallas["tokens"]
    # Tokens up to each row's first difference: after it the rows' contexts differ.
    prefix = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
    shared = np.arange(same.shape[1])[None] < prefix[:, None]
    gap = np.abs(gather["logprobs"] - pallas["logprobs"])[shared]
    return {
        "rows_identical": int(same.all(1).sum()),
        "rows": int(same.shape[0]),
        "tokens_equal": float(same.mean()),
        "mean_prefix_before_first_difference": float(prefix.mean()),
        "max_logprob_gap_on_shared_tokens": float(gap.max()) if gap.size else None,
    }


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

    def decoded(r: dict) -> str:
        if "error" in r:
            return r["error"][:200]
        compiled = r.get("shapes_compiled_in_second_call")
        return (
            f"{r['batch']} rows x {r['new_tokens_per_row']} new tokens after {r['prompt']}-token "
            f"prompts: {r['new_tokens_per_second']:,.0f} new tokens/s (first call "
            f"{r['first_call_s']:.1f} s, compile included"
            + ("" if compiled is None else f"; shapes compiled in the timed call: {compiled}")
            + ")"
        )

    if report.get("generate"):
        rows.append(f"\ngeneration: {decoded(report['generate'])}")
    for name, r in (report.get("engine") or {}).items():
        rows.append(f"engine ({name}): {decoded(r)}")
        if "first_token_ratio" in r:
            rows.append(
                f"engine ({name}) first token: {r['first_token_lone_s'] * 1000:.1f} ms alone, "
                f"{r['first_token_together_s'] * 1000:.1f} ms (median) with {r['clients']} "
                f"prompts submitted together: {r['first_token_ratio']:.2f}x"
            )
    agree = report.get("engine_agreement") or {}
    if "rows" in agree:
        rows.append(
            f"engine pallas vs gather: {agree['rows_identical']}/{agree['rows']} rows identical, "
            f"{100 * agree['tokens_equal']:.1f}% of tokens equal, "
            f"{agree['mean_prefix_before_first_difference']:.0f} tokens before a row's first "
            "difference on average; log-probs of the shared tokens differ by at most "
            f"{agree['max_logprob_gap_on_shared_tokens']}"
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
    rows += moe_rows(report) + gmm_rows(report) + grpo_rows(report)
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


def moe_rows(report: dict) -> list[str]:
    """The MoE twin per dispatch: tokens/s, MFU against the dense step's (the train stage's
    first variant, same attention and batch) and the loss against the first dispatch's."""
    moe = report.get("moe") or {}
    dense = next(iter(report["train"].values()), {})
    reference = next((r for r in moe.values() if "error" not in r), None)
    rows = []
    for impl, r in moe.items():
        if "error" in r:
            rows.append(f"moe ({impl}): {r['error'][:200]}")
            continue
        line = (
            f"moe ({impl}): {r['tokens_per_second']:,.0f} tokens/s, MFU {100 * (r['mfu'] or 0):.1f}%"
            f", step {r['step_time_s']:.3f} s, compile {r['compile_s'] or 0:.1f} s, loss {r['loss']:.4f}"
        )
        if dense.get("mfu"):
            line += f"; MFU {r['mfu'] / dense['mfu']:.2f}x the dense step's"
        if reference is not None and r is not reference:
            line += f"; {r['tokens_per_second'] / reference['tokens_per_second']:.2f}x its tokens/s"
        rows.append(line)
    return rows


def gmm_rows(report: dict) -> list[str]:
    """One grouped matmul by each kernel: ms, TFLOP/s, distance from ragged_dot's output."""
    gmm = report.get("gmm") or {}
    if "error" in gmm:
        return [f"gmm: {gmm['error'][:200]}"]
    rows = []
    for name, r in (gmm.get("kernels") or {}).items():
        head = f"gmm {gmm['rows']} x {gmm['k']} x {gmm['n']}, {gmm['experts']} groups ({name})"
        if "error" in r:
            rows.append(f"{head}: {r['error'][:200]}")
            continue
        rows.append(
            f"{head}: {r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s, at most "
            f"{r['max_abs_diff_from_ragged_dot']:.3g} from ragged_dot's output"
        )
    return rows


def grpo_rows(report: dict) -> list[str]:
    """Seconds per GRPO step, synchronous and a round ahead, and their ratio."""
    grpo = report.get("grpo") or {}
    rows = []
    for name, r in grpo.items():
        if "error" in r:
            rows.append(f"grpo ({name}): {r['error'][:200]}")
            continue
        rows.append(
            f"grpo ({name}, max_staleness {r['max_staleness']}, {r['decode_steps']} "
            f"decode steps a call): {r['step_s']:.3f} s/step over "
            f"steps {r['steady_steps']} ({r['batch']} completions of <= {r['new']} tokens, "
            f"{r['group']} per prompt)"
            + ("" if r["weight_handoff_s"] is None else f", handoff {r['weight_handoff_s']:.4f} s")
        )
    for name in ("async", "steps8"):
        if all("step_s" in grpo.get(k, {}) for k in ("sync", name)):
            ratio = grpo[name]["step_s"] / grpo["sync"]["step_s"]
            rows.append(f"grpo {name} / sync: {ratio:.2f}x")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/accelerator")
    parser.add_argument("--budget-s", type=float, default=380.0)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--engine-variants", default=",".join(ENGINE_VARIANTS))
    parser.add_argument("--grpo-variants", default=",".join(GRPO_VARIANTS))
    parser.add_argument("--tiny", action="store_true", help="the tiny model (CPU, for tests)")
    opts = parser.parse_args(argv)
    size = "tiny" if opts.tiny else "1b"
    # Each comma-separated choice, checked against what it names.
    choices = {"stages": STAGES, "variants": TRAIN_VARIANTS, "engine-variants": ENGINE_VARIANTS,
               "grpo-variants": GRPO_VARIANTS}  # fmt: skip
    chosen = {}
    for flag, table in choices.items():
        chosen[flag] = [v for v in getattr(opts, flag.replace("-", "_")).split(",") if v]
        for name in chosen[flag]:
            if name not in table:
                parser.error(f"--{flag}: unknown {name!r}; choose from {', '.join(table)}")
    stages, variants = chosen["stages"], chosen["variants"]
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + opts.budget_s
    device = device_line()
    if device.get("platform") == "cpu":
        variants = [v for v in variants if v not in GPU_ONLY]
    report: dict = {"size": size, "model": MODELS[size], "run": RUNS[size], "device": device}
    report["train"] = {}
    print(f"accelerator campaign on {device}: stages {stages}, variants {variants}", flush=True)
    first = variants[0] if variants else "blockwise"
    attention, remat, first_env, _ = TRAIN_VARIANTS[first]
    on_gpu = device.get("platform") == "gpu"
    # On a GPU the plan compiles with the GPU's own compiler once the GPU is free (after the
    # train stages); elsewhere XLA:CPU runs beside the stages from the start.
    accelerator = "h200" if "H200" in str(device.get("kind", "")) else "h100"
    plan_proc = None
    if "plan" in stages:
        plan_log = open(out / "plan.log", "w")  # noqa: SIM115 - closed after wait()
        command = plan_command(
            size, attention, remat, out, accelerator, "auto" if on_gpu else "cpu"
        )
        if not on_gpu:
            plan_proc = subprocess.Popen(command, stdout=plan_log, stderr=subprocess.STDOUT)
    tiny = ["--size", size]

    def stage(name: str, args: list[str], log: str, env: dict | None = None) -> dict:
        """The stage's worker within what is left of the budget (tiny runs have no minimum)."""
        remaining = deadline - time.perf_counter()
        if not opts.tiny and remaining < MIN_STAGE_S[name]:
            return {"error": "skipped: the budget ran out"}
        return run_stage([name, *tiny, *args], remaining, out / log, env)

    def record(key: str, result: dict) -> None:
        print(f"{key}: {json.dumps(result)[:400]}", flush=True)
        (out / "accelerator.json").write_text(json.dumps(report, indent=2) + "\n")

    first_args = ["--attention", attention, "--remat", remat]
    if "train" in stages:
        for name in variants:
            impl, policy, env, overrides = TRAIN_VARIANTS[name]
            args = ["--attention", impl, "--remat", policy, "--overrides", json.dumps(overrides)]
            report["train"][name] = stage("train", args, f"train-{name}.log", env)
            record(f"train/{name}", report["train"][name])
    if "profile" in stages:
        args = [*first_args, "--trace-dir", str(out / "trace")]
        report["profile"] = stage("profile", args, "profile.log", first_env)
        record("profile", report["profile"])
    if "engine" in stages:
        report["engine"] = {}
        accelerated = device.get("platform") in ("gpu", "tpu")
        for name in chosen["engine-variants"]:
            kernel, steps = ENGINE_VARIANTS[name]
            if kernel == "pallas" and not accelerated:
                continue
            tokens = out / f"engine-{name}.npz"
            args = ["--attention", kernel, "--decode-steps", str(steps), "--tokens", str(tokens)]
            report["engine"][name] = stage("engine", args, f"engine-{name}.log")
            record(f"engine/{name}", report["engine"][name])
        report["engine_agreement"] = engine_agreement(out)
        record("engine_agreement", report["engine_agreement"])
    if "generate" in stages:
        report["generate"] = stage("generate", [], "generate.log")
        record("generate", report["generate"])
    if "plan" in stages:
        remaining = deadline - time.perf_counter()
        if on_gpu and remaining >= MIN_STAGE_S["plan"]:
            plan_proc = subprocess.Popen(command, stdout=plan_log, stderr=subprocess.STDOUT)
        try:
            if plan_proc is None:
                raise subprocess.TimeoutExpired(command, 0)
            plan_proc.wait(timeout=max(deadline - time.perf_counter(), 5))
            report["plan"] = (
                read_plan(out / "plan.json")
                if plan_proc.returncode == 0
                else {"error": f"jaxtrain plan exited {plan_proc.returncode} (plan.log)"}
            )
        except subprocess.TimeoutExpired:
            if plan_proc is not None:
                plan_proc.kill()
            report["plan"] = {"error": "jaxtrain plan did not finish inside the budget"}
        plan_log.close()
        record("plan", report["plan"])
    if "batch" in stages:
        report["batch"] = stage("batch", first_args, "batch.log", first_env)
        record("batch", report["batch"])
    if "moe" in stages:
        report["moe"] = {}
        for impl in MOE_VARIANTS.get(device.get("platform"), MOE_VARIANTS["cpu"]):
            args = [*first_args, "--moe", impl]
            report["moe"][impl] = stage("moe", args, f"moe-{impl}.log", first_env)
            record(f"moe/{impl}", report["moe"][impl])
    if "gmm" in stages:
        report["gmm"] = stage("gmm", [], "gmm.log")
        record("gmm", report["gmm"])
    if "grpo" in stages:
        report["grpo"] = {}
        for name in chosen["grpo-variants"]:
            staleness, steps = GRPO_VARIANTS[name]
            args = ["--max-staleness", str(staleness), "--decode-steps", str(steps)]
            report["grpo"][name] = stage("grpo", args, f"grpo-{name}.log")
            record(f"grpo/{name}", report["grpo"][name])
    table = markdown(report)
    (out / "accelerator.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    failed = [k for k, v in report["train"].items() if "error" in v]
    return 1 if failed and len(failed) == len(report["train"]) else 0


if __name__ == "__main__":
    sys.exit(main())
