"""The `easydel` variant of overhead.py: EasyDeL's own Llama and Trainer on the same data.

    /tmp/edl/bin/python bench/easydel_worker.py --size S1|S2 --steps N --warmup W
    /tmp/edl/bin/python bench/easydel_worker.py --check   # same losses as handwritten_llama

Runs with EasyDeL's interpreter (a separate venv, never a jaxtrain dependency:
`python -m venv /tmp/edl && /tmp/edl/bin/pip install easydel==0.3.0 pillow`; easydel imports
PIL without declaring it, and works without torch once stub_torch_only_hf_modules ran); overhead.py
starts it for `--variants ...,easydel` with $BENCH_EASYDEL_PYTHON (default /tmp/edl/bin/python).
It imports nothing from jaxtrain: only numpy, psutil, jax, datasets, easydel, measure.py's
SIZES / make_tokens / StepClock and overhead.py's run_handwritten (overhead.py imports jaxtrain
only inside its runners).

What runs: `easydel.LlamaForCausalLM` with the shape of SIZES[size] (fp32 dtype, param_dtype
and attention dtype, vanilla attention, rope theta 10000, RMS eps 1e-6, init std 0.02), trained
by `easydel.Trainer` with its `TrainingArguments`: total batch = shape.batch, max_length =
shape.seq, max_training_steps = N, one epoch, AdamW (eformer's optax.adamw, b1 0.9, b2 0.999,
eps 1e-8) at a constant 3e-4 (scheduler "none"), no weight decay, no clipping, no evaluation,
no checkpoint, no wandb / TensorBoard, no resume. The data is a datasets.Dataset of the rows
of make_tokens (the same seed and rows as the other variants, in order: no shuffle), with
`attention_mask` all ones; EasyDeL's causal-LM loss takes `labels = input_ids` and shifts them.

How the timing matches overhead.py's: the worker subclasses easydel.Trainer and overrides its
`on_step_end(state, metrics, step)` hook, which `Trainer._train_epoch` calls once per step
after the compiled step (with `step` = the state's step counter after it, 1..N); it hands
(step, state, metrics.loss) to the same `StepClock.after_step` as the other variants, which
blocks on the state after steps 1, W and N and stamps the time there. tokens/s is
(N - W) * batch * seq over the wall time between the marks after step W and after step N;
"first step" is from the process's creation to the mark after step 1. `imports_s` is stamped
after `import easydel` and its Llama/Trainer modules (jax itself comes with overhead.py, as in
the other workers) and
`ready_s` after the Trainer object exists (model init, state/optimizer init and dataloader are
setup; EasyDeL jits its step in the constructor but compiles it on the first call).

EasyDeL blocks on every step's result itself (`jax.block_until_ready` in
`Trainer._execute_train_step`) and reads the step counter, loss, accuracy and every
parameter's gradient norm back to the host each step (its default metrics), so StepClock's own
blocks find the work already done; that per-step synchronisation is EasyDeL's and is part of
what is measured. Its tqdm bar (no "off" setting) writes to stderr every log_steps=10 steps.

The XLA persistent compilation cache: EasyDeL's `ejit` points JAX's cache at
$COMPILE_FUNC_DIR (default ~/.cache/ejkernel-cache/ejit_compiled_functions), which would make
every run after the first a warm start. The worker sets COMPILE_FUNC_DIR to a fresh temporary
directory (cold start, like the other variants; writing the cache is still paid, as on a
user's first run), or to $BENCH_TRAINER_CACHE/easydel when overhead.py runs --trainer-cache warm.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import (  # noqa: E402 - bench/ is not a package; imports no jaxtrain
    DEFAULT_STEPS,
    LEARNING_RATE,
    RESULT_PREFIX,
    SEED,
    SIZES,
    StepClock,
    make_tokens,
)
from overhead import run_handwritten  # noqa: E402

# transformers modules that EasyDeL's config modules patch on import; without torch,
# transformers 5.5 hands back placeholders whose attribute access raises ImportError.
TORCH_ONLY_HF_MODULES = ("glm4v_moe", "llama4", "phimoe", "qwen3_5_moe", "qwen3_next")


def stub_torch_only_hf_modules() -> None:
    """Bind each transformers.models.<name>.modeling_<name> to an empty module (no torch)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        return
    for name in TORCH_ONLY_HF_MODULES:
        full = f"transformers.models.{name}.modeling_{name}"
        stub = sys.modules[full] = types.ModuleType(full)
        # `from transformers.models.X import modeling_X` reads the lazy package's attribute.
        setattr(importlib.import_module(f"transformers.models.{name}"), f"modeling_{name}", stub)


def easydel_llama(shape):
    """EasyDeL's LlamaForCausalLM of `shape`, fp32 throughout, seeded with SEED."""
    import easydel as ed
    import jax.numpy as jnp
    from flax import nnx

    config = ed.LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=shape.seq,
        rms_norm_eps=shape.eps,
        rope_theta=shape.rope_theta,
        initializer_range=shape.init_std,
        tie_word_embeddings=False,
        attn_mechanism="vanilla",  # EasyDeL's default (etils.DEFAULT_ATTENTION_MECHANISM)
        attn_dtype=jnp.float32,  # default bfloat16
        attn_softmax_dtype=jnp.float32,
    )
    return ed.LlamaForCausalLM(
        config=config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(SEED)
    )


def run_easydel(shape, tokens, clock: StepClock) -> dict:
    stub_torch_only_hf_modules()
    import easydel as ed
    import flax.nnx  # noqa: F401

    # easydel's package is lazy: load the modules used below now, so imports_s holds them.
    ed.LlamaConfig, ed.LlamaForCausalLM, ed.Trainer, ed.TrainingArguments  # noqa: B018
    clock.mark("imports_s")
    import datasets  # the user's data; counted in setup like trainer_hf (EasyDeL loaded it)

    dataset = datasets.Dataset.from_dict(
        {"input_ids": tokens.tolist(), "attention_mask": np.ones_like(tokens).tolist()}
    )
    model = easydel_llama(shape)

    class TimedTrainer(ed.Trainer):
        def on_step_end(self, state, metrics, step):
            clock.after_step(step, state, metrics.loss)
            return super().on_step_end(state, metrics, step)

    out_dir = tempfile.mkdtemp(prefix="easydel-bench-")
    try:
        arguments = ed.TrainingArguments(
            save_directory=out_dir,
            model_name="bench",
            learning_rate=LEARNING_RATE,
            optimizer="adamw",
            scheduler="none",
            weight_decay=0.0,
            clip_grad=None,
            warmup_steps=0,
            max_training_steps=clock.steps,
            num_train_epochs=1,
            total_batch_size=shape.batch,
            gradient_accumulation_steps=1,
            max_length=shape.seq,
            shuffle_train_dataset=False,  # rows in order, like the other variants
            do_eval=False,
            do_last_save=False,
            save_steps=None,
            resume_if_possible=False,
            use_wandb=False,
            report_metrics=False,  # no wandb / TensorBoard writes
            log_steps=10,  # progress bar updates, as jaxtrain's logging_steps=10
            progress_bar_type="tqdm",  # no "none" option (tqdm, rich or json), to stderr
        )
        trainer = TimedTrainer(arguments=arguments, model=model, dataset_train=dataset)
        clock.mark("ready_s")
        trainer.train()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    result = clock.summary(shape)
    result["compile_s"] = None  # EasyDeL does not report its compile time apart
    return result


def handwritten_params(model, shape) -> dict:
    """EasyDeL's Llama weights as handwritten_llama params (both store kernels [in, out])."""
    from flax import nnx

    w = nnx.to_pure_dict(nnx.state(model, nnx.Param))["model"]
    layers = []
    for i in range(shape.layers):
        lw = w["layers"][i]
        attn, mlp = lw["self_attn"], lw["mlp"]
        layers.append(
            {
                "attn_norm": lw["input_layernorm"]["kernel"],
                "wq": attn["q_proj"]["kernel"],
                "wk": attn["k_proj"]["kernel"],
                "wv": attn["v_proj"]["kernel"],
                "wo": attn["o_proj"]["kernel"],
                "mlp_norm": lw["post_attention_layernorm"]["kernel"],
                "w_gate": mlp["gate_proj"]["kernel"],
                "w_up": mlp["up_proj"]["kernel"],
                "w_down": mlp["down_proj"]["kernel"],
            }
        )
    head = nnx.to_pure_dict(nnx.state(model, nnx.Param))["lm_head"]["kernel"]
    return {
        "embed": w["embed_tokens"]["embedding"],
        "layers": layers,
        "final_norm": w["norm"]["kernel"],
        "lm_head": head,
    }


def check() -> None:
    """EasyDeL's Trainer and the hand-written loop, from the same initial weights (EasyDeL's,
    seed SEED), give the same per-step losses on shape T (rtol 1e-4): same model maths,
    loss and optimizer, so the easydel row of overhead.py is like for like."""
    shape, steps = SIZES["T"], DEFAULT_STEPS["T"]
    tokens = make_tokens(shape, steps)
    stub_torch_only_hf_modules()
    ours = run_easydel(shape, tokens, StepClock(time.time(), 1, steps))["losses"]
    params = handwritten_params(easydel_llama(shape), shape)
    reference = run_handwritten(shape, tokens, StepClock(time.time(), 1, steps), params=params)
    print("easydel    ", [round(x, 6) for x in ours])
    print("handwritten", [round(x, 6) for x in reference["losses"]])
    np.testing.assert_allclose(ours, reference["losses"], rtol=1e-4)
    print("check passed: easydel and handwritten losses agree (rtol 1e-4)")


def worker(size: str, steps: int, warmup: int) -> None:
    start = psutil.Process().create_time()
    shape = SIZES[size]
    clock = StepClock(start, warmup, steps)
    result = run_easydel(shape, make_tokens(shape, steps), clock)
    result.update(
        variant="easydel",
        size=size,
        steps=steps,
        warmup=warmup,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size", choices=("S1", "S2"), default="S1")
    p.add_argument("--steps", type=int, default=None, help="default: 30 for S1, 12 for S2")
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from tokens/s (>= 1)")
    p.add_argument("--check", action="store_true", help="verify the losses, then exit")
    args = p.parse_args()
    steps = args.steps or DEFAULT_STEPS[args.size]
    if not 1 <= args.warmup < steps:
        raise ValueError(f"--warmup must be in [1, steps={steps}), got {args.warmup}")
    # ejit's XLA cache (read when ejkernel is imported): cold unless overhead.py warms it.
    warm = os.environ.get("BENCH_TRAINER_CACHE")
    cache_dir = os.path.join(warm, "easydel") if warm else tempfile.mkdtemp(prefix="ejit-")
    os.makedirs(cache_dir, exist_ok=True)
    os.environ["COMPILE_FUNC_DIR"] = cache_dir
    try:
        check() if args.check else worker(args.size, steps, args.warmup)
    finally:
        if not warm:
            shutil.rmtree(cache_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
