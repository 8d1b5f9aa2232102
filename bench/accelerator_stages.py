"""The stages of bench/accelerator.py (the one-command GPU campaign), each run in a process
of its own by the campaign: `python bench/accelerator_stages.py STAGE [--size S]
[--attention A] [--remat R] [--trace-dir DIR]` prints one ACCELERATOR_RESULT line (JSON).
Stages: train, profile, generate, engine, batch, moe, gmm, grpo (see bench/accelerator.py for what each
measures). `--overrides JSON` sets TrainingArguments fields of a train variant (mu_dtype,
scan_layers); `--moe IMPL` trains the size's mixture-of-experts twin with that dispatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULT_PREFIX = "ACCELERATOR_RESULT "

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


# The MoE twin of a size: 8 experts of half the dense MLP's width, top-2, so a token's
# active MLP is the dense model's (its step's MFU is comparable with the dense step's).
MOE_EXPERTS, MOE_TOP_K = 8, 2


def model_config(size: str, moe: str | None = None):
    from jaxtrain.models import LlamaConfig
    from jaxtrain.models.moe import MoeConfig

    if moe is None:
        return LlamaConfig(**MODELS[size])
    shape = dict(MODELS[size], intermediate_size=MODELS[size]["intermediate_size"] // MOE_TOP_K)
    return MoeConfig(**shape, num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                     router_aux_loss_coef=0.01, moe_implementation=moe)  # fmt: skip


def training_arguments(
    out_dir: str, size: str, batch: int, steps: int, remat: str, overrides: dict | None = None
):
    from jaxtrain import TrainingArguments

    run = RUNS[size]
    return TrainingArguments(
        **(overrides or {}),
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


def build_model(size: str, attention: str, moe: str | None = None):
    from flax import nnx

    from jaxtrain.models import LlamaForCausalLM
    from jaxtrain.models.moe import MoeForCausalLM
    from jaxtrain.parallel import ModelFactory

    def build():
        family = LlamaForCausalLM if moe is None else MoeForCausalLM
        model = family(model_config(size, moe), rngs=nnx.Rngs(0))
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
    size: str,
    attention: str,
    remat: str,
    batch: int | None = None,
    trace_dir: Path | None = None,
    overrides: dict | None = None,
    moe: str | None = None,
) -> dict:
    """The Trainer for RUNS[size]'s steps; its own logged figures of the last window. With
    `trace_dir`, that window is traced (jax.profiler) and summed by kernel; with `moe`, the
    size's MoE twin is trained with that expert dispatch."""
    from jaxtrain import Trainer

    run = RUNS[size]
    batch = batch or run["batch"]
    steps = run["steps"]
    with tempfile.TemporaryDirectory(prefix="jaxtrain-accel-") as out_dir:
        args = training_arguments(out_dir, size, batch, steps, remat, overrides)
        trainer = Trainer(
            arguments=args,
            model=build_model(size, attention, moe),
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
        "overrides": overrides or {},
        "moe": moe,
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

    from jaxtrain.config.sections import RunSettings
    from jaxtrain.planning.program import compile_step, plan_step_program

    args = training_arguments("unused", size, batch, RUNS[size]["steps"], remat)
    impl = None if attention == "auto" else attention
    program = plan_step_program(model_config(size), args, jax.devices()[:1], impl)
    figures, seconds = compile_step(program, RunSettings.from_arguments(args))
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


def decoding_model(size: str):
    """The model the decoding stages run: bf16 parameters and compute."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxtrain.models import LlamaForCausalLM

    bf16 = jnp.bfloat16
    return LlamaForCausalLM(model_config(size), dtype=bf16, param_dtype=bf16, rngs=nnx.Rngs(0))


def decoding_prompts(size: str, seed: int) -> np.ndarray:
    """[gen_batch, prompt] random token ids."""
    run = RUNS[size]
    shape = (run["gen_batch"], run["prompt"])
    return np.random.default_rng(seed).integers(0, MODELS[size]["vocab_size"], shape, np.int32)


def generation(size: str) -> dict:
    """New tokens per second of greedy `generate` with a KV cache, bf16 parameters."""
    import jax

    from jaxtrain.models import generate

    run = RUNS[size]
    model, prompts = decoding_model(size), decoding_prompts(size, 1)
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


def first_tokens(engine, prompts: np.ndarray) -> list[float]:
    """Seconds from submitting `prompts` together to each one's first token (4 tokens each)."""
    from jaxtrain.serving import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first: dict[int, float] = {}
    start = time.perf_counter()

    def on_token(request_id, index, token, logprob, top) -> None:
        first.setdefault(request_id, time.perf_counter() - start)

    ids = [engine.submit(list(p), params, on_token=on_token) for p in prompts]
    while not engine.idle:
        engine.step()
    return [first[i] for i in ids]


def first_token_latency(engine, size: str) -> dict:
    """Issue 45's first-token goal at the engine: a lone prompt's first token against the
    median of 8 prompts submitted together (new prompts each time: no prefix cache), after
    one untimed round of each (their shapes compiled)."""
    clients = min(8, RUNS[size]["gen_batch"])

    def round_(seed: int) -> tuple[float, float]:
        lone = first_tokens(engine, decoding_prompts(size, seed)[:1])[0]
        together = first_tokens(engine, decoding_prompts(size, seed + 1)[:clients])
        return lone, float(np.median(together))

    def compiled() -> int:
        return sum(len(v) for v in engine.steps.compiles.values())

    round_(3)  # untimed: compiles the shapes
    before = compiled()
    lone, together = round_(5)
    return {
        "clients": clients,
        "first_token_lone_s": lone,
        "first_token_together_s": together,
        "first_token_ratio": together / lone,
        "shapes_compiled_while_timed": compiled() - before,
    }


def engine_decode(size: str, attention: str, decode_steps: int, tokens_path: Path) -> dict:
    """New tokens per second of the serving engine (paged KV pool, greedy, bf16 parameters),
    its pages read by `attention` ("gather" or "pallas"), `decode_steps` tokens per decode
    call. The first call compiles; the timed second call has prompts of its own (the same
    prompts would hit the prefix cache and prefill a shape the first call did not compile),
    and the shapes it compiled are counted. Its tokens and log-probs are saved to
    `tokens_path` (.npz) for the parent to compare. Then the first token's latency, alone
    and with 8 prompts submitted together (first_token_latency)."""
    from jaxtrain.serving import Engine, SamplingParams

    run = RUNS[size]
    engine = Engine(
        decoding_model(size),
        max_slots=run["gen_batch"],
        max_length=run["prompt"] + run["new"],
        prefill_tokens=run["gen_batch"] * run["prompt"],
        attention=attention,
        decode_steps=decode_steps,
    )
    params = SamplingParams(max_tokens=run["new"], temperature=0.0, ignore_eos=True)
    times, shapes = [], []
    for seed in (2, 1):  # the first call compiles; the second, timed, is generation()'s prompts
        prompts = decoding_prompts(size, seed)
        start = time.perf_counter()
        out = engine.generate([list(p) for p in prompts], params)
        times.append(time.perf_counter() - start)
        shapes.append(sum(len(v) for v in engine.steps.compiles.values()))
    tokens = np.array([request[0].token_ids for request in out], dtype=np.int32)
    logprobs = np.array([request[0].logprobs for request in out], dtype=np.float32)
    np.savez(tokens_path, tokens=tokens, logprobs=logprobs)
    return {
        "attention": attention,
        "decode_steps": decode_steps,
        "batch": run["gen_batch"],
        "prompt": run["prompt"],
        "new_tokens_per_row": int(tokens.shape[1]),
        "first_call_s": times[0],
        "second_call_s": times[1],
        "shapes_compiled_in_second_call": shapes[1] - shapes[0],
        "new_tokens_per_second": tokens.size / times[1],
        "tokens": str(tokens_path),
        **first_token_latency(engine, size),
    }


def run_worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("stage")
    parser.add_argument("--size", default="1b")
    parser.add_argument("--attention", default="cudnn")
    parser.add_argument("--remat", default="none")
    parser.add_argument("--trace-dir", type=Path)
    parser.add_argument("--decode-steps", type=int, default=1)
    parser.add_argument("--tokens", type=Path, help="engine: where its tokens are saved")
    parser.add_argument("--overrides", type=json.loads, default={})
    parser.add_argument("--moe", help="moe: the expert dispatch (moe_implementation)")
    parser.add_argument("--max-staleness", type=int, default=0, help="grpo: 0 sync, 1 async")
    opts = parser.parse_args(argv)
    if opts.stage == "train":
        result = train(opts.size, opts.attention, opts.remat, overrides=opts.overrides)
    elif opts.stage == "profile":
        result = train(opts.size, opts.attention, opts.remat, trace_dir=opts.trace_dir)
    elif opts.stage == "generate":
        result = generation(opts.size)
    elif opts.stage == "engine":
        result = engine_decode(opts.size, opts.attention, opts.decode_steps, opts.tokens)
    elif opts.stage == "gmm":
        from accelerator_gmm import grouped_matmul_kernels

        result = grouped_matmul_kernels(opts.size)
    elif opts.stage == "grpo":
        from accelerator_grpo import grpo_step

        result = grpo_step(opts.size, opts.max_staleness, opts.decode_steps)
    elif opts.stage == "moe":
        result = train(opts.size, opts.attention, opts.remat, moe=opts.moe)
    elif opts.stage == "batch":
        result = largest_batch(opts.size, opts.attention, opts.remat)
    else:
        raise SystemExit(f"unknown stage {opts.stage!r}")
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    run_worker(sys.argv[1:])
