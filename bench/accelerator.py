"""The GPU campaign in one command: a ~1B Llama in bf16 at sequence 4096 on one accelerator.

    python bench/accelerator.py [--out DIR] [--budget-s 380] [--stages train,generate,batch,plan]
    python bench/accelerator.py --tiny          # the same stages on a tiny model (CPU, make test)

Every stage runs in its own process (`--worker STAGE ...`), so a stage that runs out of memory
or crashes costs only itself; the parent keeps a wall-clock budget and skips what no longer
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
import tempfile
import time
from pathlib import Path

import numpy as np

RESULT_PREFIX = "ACCELERATOR_RESULT "
ROOT = Path(__file__).resolve().parent.parent

# TinyLlama-1.1B's shape (1.10B parameters): a public ~1B Llama with grouped-query attention.
MODELS = {
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rope_theta=10000.0,
    ),
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
}
# seq, rows per step, steps (the first `warmup` are excluded from the figures), generation.
RUNS = {
    "1b": dict(seq=4096, batch=4, steps=12, warmup=4, gen_batch=32, prompt=128, new=256),
    "tiny": dict(seq=128, batch=2, steps=6, warmup=2, gen_batch=2, prompt=8, new=8),
}
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


def model_config(size: str):
    from jaxtrain.models import LlamaConfig

    return LlamaConfig(**MODELS[size])


def training_arguments(out_dir: str, size: str, batch: int, steps: int, remat: str):
    from jaxtrain import TrainingArguments

    run = RUNS[size]
    return TrainingArguments(
        output_dir=out_dir,
        overwrite_output_dir=True,
        seed=0,
        learning_rate=3e-4,
        optimizer="adamw",
        scheduler="constant",
        max_steps=steps,
        total_batch_size=batch,
        max_sequence_length=run["seq"],
        shuffle_train=False,
        dtype="bfloat16",
        gradient_checkpointing=remat,
        # One logging window over the steady steps: the Trainer logs at steps W and N, and
        # the window (W, N] is what the figures are.
        logging_steps=run["warmup"],
        evaluation_strategy="no",
        save_final=False,
        progress_bar="none",
        run_report=False,
        track_memory=True,
        compilation_cache_dir=None,
    )


def random_rows(size: str, rows: int) -> list[dict]:
    run, vocab = RUNS[size], MODELS[size]["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, size=(rows, run["seq"]), dtype=np.int32)
    return [{"input_ids": row} for row in tokens]


def build_model(size: str, attention: str):
    from flax import nnx

    from jaxtrain.models import LlamaForCausalLM
    from jaxtrain.parallel import ModelFactory

    def build():
        model = LlamaForCausalLM(model_config(size), rngs=nnx.Rngs(0))
        model.attention_implementation = None if attention == "auto" else attention
        return model

    return ModelFactory(build)


def profiled_window(warmup: int, steps: int, trace_dir: Path):
    """A callback tracing steps warmup+1..steps with jax.profiler (blocking at both ends, so
    the trace holds exactly those steps' device work)."""
    import jax

    from jaxtrain import TrainerCallback

    class Profile(TrainerCallback):
        def on_step_end(self, trainer, state, metrics, step):
            if step == warmup:
                jax.block_until_ready(state)
                jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
            elif step == steps:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()

    return Profile()


def train(
    size: str, attention: str, remat: str, batch: int | None = None, trace_dir: Path | None = None
) -> dict:
    """The Trainer for RUNS[size]'s steps; its own logged figures of the last window. With
    `trace_dir`, that window is traced (jax.profiler) and summed by kernel."""
    from jaxtrain import Trainer

    run = RUNS[size]
    batch = batch or run["batch"]
    steps = run["steps"]
    with tempfile.TemporaryDirectory(prefix="jaxtrain-accel-") as out_dir:
        args = training_arguments(out_dir, size, batch, steps, remat)
        trainer = Trainer(
            arguments=args,
            model=build_model(size, attention),
            dataset_train=random_rows(size, batch * steps),
            callbacks=[]
            if trace_dir is None
            else [profiled_window(run["warmup"], steps, trace_dir)],
        )
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        lines = [json.loads(x) for x in Path(out_dir, "metrics.jsonl").read_text().splitlines()]
        run_info = json.loads(Path(out_dir, "run_info.json").read_text())
    windows = [x for x in lines if "tokens_per_second" in x]
    last = windows[-1]
    compile_s = next(
        (x["compile/train_step_s"] for x in lines if "compile/train_step_s" in x), None
    )
    keep = ("tokens_per_second", "padded_tokens_per_second", "tflops_per_device", "mfu")
    result = {
        "attention": attention,
        "remat": remat,
        "batch": batch,
        "seq": run["seq"],
        "steps": steps,
        "window_steps": f"{last['step'] - run['warmup'] + 1}-{last['step']}",
        **{k: last.get(k) for k in keep},
        "step_time_s": last.get("step_time_s"),
        "loss": last.get("loss"),
        "memory": {k: v for k, v in last.items() if k.startswith("memory/")},
        "compile_s": compile_s,
        "compiled_memory": run_info.get("train_step_memory"),
        "wall_s": wall,
    }
    if trace_dir is not None:
        from trace_summary import summarize

        result["trace"] = {"dir": str(trace_dir), **summarize(trace_dir)}
    return result


def compiled_peak(size: str, attention: str, remat: str, batch: int) -> dict:
    """The accelerator compiler's memory analysis of the train step at `batch` (from shapes)."""
    import jax

    from jaxtrain.planning.program import compile_step, plan_step_program

    args = training_arguments("unused", size, batch, RUNS[size]["steps"], remat)
    impl = None if attention == "auto" else attention
    program = plan_step_program(model_config(size), args, jax.devices()[:1], impl)
    figures, seconds = compile_step(program, args)
    return {"batch": batch, "memory": figures["memory"], "compile_s": seconds}


def largest_batch(size: str, attention: str, remat: str) -> dict:
    """A line through the compiled peak at two batches, to the device's memory limit; then
    real steps at the batch it gives (one fewer row each time that one does not fit)."""
    import jax

    base = RUNS[size]["batch"]
    small, large = (compiled_peak(size, attention, remat, b) for b in (base, 2 * base))
    per_row = (large["memory"]["peak"] - small["memory"]["peak"]) / base
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    result = {"attention": attention, "remat": remat, "compiled": [small, large]}
    result["per_row_bytes"] = per_row
    result["limit_bytes"] = limit
    if not limit or per_row <= 0:
        result["error"] = "the device reports no memory limit (or the peak does not grow)"
        return result
    fixed = small["memory"]["peak"] - per_row * base
    predicted = int((limit - fixed) // per_row)
    result["predicted"] = predicted
    result["tried"] = []
    for batch in range(predicted, max(predicted - 3, 0), -1):
        try:
            measured = train(size, attention, remat, batch=batch)
        except Exception as err:  # out of memory: recorded, the next smaller batch is tried
            result["tried"].append({"batch": batch, "error": str(err).splitlines()[0][:300]})
            continue
        result["tried"].append({"batch": batch, "ok": True})
        result["largest"] = measured
        break
    return result


def generation(size: str) -> dict:
    """New tokens per second of greedy `generate` with a KV cache, bf16 parameters."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxtrain.models import LlamaForCausalLM, generate

    run = RUNS[size]
    model = LlamaForCausalLM(
        model_config(size), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
    )
    vocab = MODELS[size]["vocab_size"]
    prompts = np.random.default_rng(1).integers(
        0, vocab, size=(run["gen_batch"], run["prompt"]), dtype=np.int32
    )
    times = []
    for _ in range(2):  # the first call compiles
        start = time.perf_counter()
        out = generate(model, prompts, max_new_tokens=run["new"])
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    new_tokens = out.shape[0] * out.shape[1]
    return {
        "batch": run["gen_batch"],
        "prompt": run["prompt"],
        "new_tokens_per_row": int(out.shape[1]),
        "first_call_s": times[0],
        "second_call_s": times[1],
        "new_tokens_per_second": new_tokens / times[1],
    }


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


def run_worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage")
    parser.add_argument("--size", default="1b")
    parser.add_argument("--attention", default="cudnn")
    parser.add_argument("--remat", default="none")
    parser.add_argument("--trace-dir", type=Path)
    opts = parser.parse_args(argv)
    if opts.stage == "train":
        result = train(opts.size, opts.attention, opts.remat)
    elif opts.stage == "profile":
        result = train(opts.size, opts.attention, opts.remat, trace_dir=opts.trace_dir)
    elif opts.stage == "generate":
        result = generation(opts.size)
    elif opts.stage == "batch":
        result = largest_batch(opts.size, opts.attention, opts.remat)
    else:
        raise SystemExit(f"unknown stage {opts.stage!r}")
    print(RESULT_PREFIX + json.dumps(result), flush=True)


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
    command = [sys.executable, __file__, "--worker", *args]
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
    if argv[:1] == ["--worker"]:
        run_worker(argv[1:])
        return 0
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
