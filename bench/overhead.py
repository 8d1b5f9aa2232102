"""Overhead of the jaxtrain Trainer against a bare jitted step and a hand-written Llama.

    python bench/overhead.py [--sizes S1,S2] [--steps N] [--warmup W] [--repeats R] [--json P]
    python bench/overhead.py --check        # the three variants compute the same losses

Each variant trains the same model shape on the same random tokens in its OWN process
(`--worker trainer|bare|handwritten`), so start-up time and peak RSS are per variant:
- trainer: jaxtrain's Trainer on the same numpy rows (a list of {"input_ids": row});
- trainer_hf (with --variants): the Trainer on a datasets.Dataset of those rows;
- trainer_factory (with --variants): the Trainer given a ModelFactory instead of a built
  model, its start-up path: the parameters and optimizer state come from one jitted init
  (the same values as the eager model's) instead of one eager random call per parameter;
- trainer_xla_defaults (with --variants): the Trainer with xla_compiler_options={} (XLA's
  own compile options instead of jaxtrain's CPU defaults, jaxtrain/runtime/compiler.py);
- bare: the same jaxtrain LlamaForCausalLM, nnx.split, one jax.jit(value_and_grad + optax
  adamw, state donated) fed numpy batches in a plain Python loop;
- handwritten: bench/handwritten_llama.py (pure JAX, plain dict params) with the same step;
- cli (with --variants): `jaxtrain train config.yaml` on a jsonl file of the same rows, the
  same shape and optimizer, started in its own process by bench/cli_worker.py (first step and
  tokens/s from its metrics.jsonl: see that file);
- easydel (with --variants): EasyDeL 0.3.0's own LlamaForCausalLM and Trainer on the same rows,
  run by bench/easydel_worker.py in EasyDeL's separate venv (never a jaxtrain dependency):
      python -m venv /tmp/edl && /tmp/edl/bin/pip install easydel==0.3.0 pillow
  $BENCH_EASYDEL_PYTHON names that interpreter (default /tmp/edl/bin/python);
  `/tmp/edl/bin/python bench/easydel_worker.py --check` verifies its losses.
Same optimizer (adamw, constant lr, no clipping, no weight decay) and loss for all.

Metrics (see README.md): tokens/s counts batch * seq positions per step (no padding in this
data) over the steady-state steps W+1..N, timed between a block_until_ready after step W and
one after step N. "first step" is the time from the process's creation to the first step's
result being ready (imports, data, model init, compile included). Peak RSS is ru_maxrss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handwritten_llama import LlamaShape  # noqa: E402 - bench/ is not a package
from measure import (  # noqa: E402
    DEFAULT_STEPS,
    LEARNING_RATE,
    RESULT_PREFIX,
    SEED,
    SIZES,
    StepClock,
    make_tokens,
)

VARIANTS = (
    "trainer",
    "bare",
    "handwritten",
    "trainer_hf",
    "trainer_factory",
    "trainer_xla_defaults",
    "easydel",  # bench/easydel_worker.py, in EasyDeL's own venv
    "cli",  # bench/cli_worker.py: `jaxtrain train config.yaml` on the same rows
)
DEFAULT_VARIANTS = "trainer,bare,handwritten"


def jaxtrain_config(shape: LlamaShape):
    from jaxtrain.models import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        rms_norm_eps=shape.eps,
        rope_theta=shape.rope_theta,
        initializer_range=shape.init_std,
    )


def run_trainer(
    shape: LlamaShape,
    tokens: np.ndarray,
    clock: StepClock,
    hf: bool = False,
    factory: bool = False,
    compiler_options: dict | None = None,
) -> dict:
    """The Trainer fed the bare loops' numpy rows (a list of {"input_ids": row}); with `hf`,
    a datasets.Dataset of them instead (its import and Arrow memory are the user's); with
    `factory`, given a ModelFactory (the model is created inside the Trainer's jitted init);
    `compiler_options` is its xla_compiler_options (None: jaxtrain's defaults)."""
    from flax import nnx

    from jaxtrain import Trainer, TrainerCallback, TrainingArguments
    from jaxtrain.models import LlamaForCausalLM
    from jaxtrain.parallel import ModelFactory

    clock.mark("imports_s")
    if hf:
        import datasets  # the user's data; counted in setup

        dataset = datasets.Dataset.from_dict({"input_ids": tokens.tolist()})
    else:
        dataset = [{"input_ids": row} for row in tokens]
    steps = clock.steps

    class Timer(TrainerCallback):
        def on_step_end(self, trainer, state, metrics, step):
            # Kept as a pair of device scalars: dividing here would dispatch an extra op.
            clock.after_step(step, state, (metrics["loss_sum"], metrics["tokens"]))

    def build():
        return LlamaForCausalLM(jaxtrain_config(shape), rngs=nnx.Rngs(SEED))

    model = ModelFactory(build) if factory else build()
    with tempfile.TemporaryDirectory(prefix="jaxtrain-bench-") as out_dir:
        arguments = TrainingArguments(
            output_dir=out_dir,
            overwrite_output_dir=True,
            seed=SEED,
            learning_rate=LEARNING_RATE,
            optimizer="adamw",
            scheduler="constant",
            weight_decay=0.0,
            clip_grad=None,
            max_steps=steps,
            total_batch_size=shape.batch,
            gradient_accumulation_steps=1,
            max_sequence_length=shape.seq,
            shuffle_train=False,  # rows in order, like the bare loop: identical losses
            logging_steps=10,
            evaluation_strategy="no",
            save_final=False,
            progress_bar="none",
            run_report=False,  # the bare loops draw no plots either
            # Cold start by default, like the bare loops; --trainer-cache warm measures a rerun.
            compilation_cache_dir=os.environ.get("BENCH_TRAINER_CACHE") or None,
            xla_compiler_options=compiler_options,
        )
        trainer = Trainer(
            arguments=arguments, model=model, dataset_train=dataset, callbacks=[Timer()]
        )
        clock.mark("ready_s")
        trainer.train()
        compile_line = Path(out_dir, "metrics.jsonl").read_text().splitlines()[0]
    result = clock.summary(shape)
    result["compile_s"] = json.loads(compile_line).get("compile/train_step_s")
    return result


def adamw():
    import optax

    # Same as the Trainer's adamw with weight_decay=0 and a constant schedule.
    return optax.adamw(LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)


def run_loop(loss_fn, params, tokens: np.ndarray, shape: LlamaShape, clock: StepClock) -> dict:
    """The bare training loop shared by the bare and handwritten variants."""
    import jax
    import optax

    tx = adamw()

    def train_step(state, input_ids):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, input_ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    step_fn = jax.jit(train_step, donate_argnums=0)
    state = (params, tx.init(params))
    clock.mark("ready_s")
    for step in range(clock.steps):
        batch = tokens[step * shape.batch : (step + 1) * shape.batch]
        state, loss = step_fn(state, batch)
        clock.after_step(step + 1, state, loss)
    return clock.summary(shape)


def jaxtrain_loss(shape: LlamaShape):
    """(loss(params, input_ids), params) of jaxtrain's Llama with the Trainer's loss sums."""
    from flax import nnx

    from jaxtrain.models import LlamaForCausalLM
    from jaxtrain.training.step import causal_lm_sums

    model = LlamaForCausalLM(jaxtrain_config(shape), rngs=nnx.Rngs(SEED))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, input_ids):
        logits = nnx.merge(graphdef, params, rest)(input_ids)
        sums = causal_lm_sums(logits, input_ids)  # labels aligned with the inputs
        return sums["loss_sum"] / sums["tokens"]

    return loss_fn, params  # the model's arrays are the params: donated to the first step


def run_bare(shape: LlamaShape, tokens: np.ndarray, clock: StepClock) -> dict:
    import flax.nnx  # noqa: F401 - the imports are timed apart from the model's creation

    import jaxtrain.models  # noqa: F401
    import jaxtrain.training.step  # noqa: F401

    clock.mark("imports_s")
    loss_fn, params = jaxtrain_loss(shape)
    return run_loop(loss_fn, params, tokens, shape, clock)


def run_handwritten(shape: LlamaShape, tokens: np.ndarray, clock: StepClock, params=None) -> dict:
    import handwritten_llama as hw
    import jax

    clock.mark("imports_s")
    if params is None:
        params = hw.init_params(jax.random.key(SEED), shape)
    return run_loop(lambda p, ids: hw.next_token_loss(p, ids, shape), params, tokens, shape, clock)


RUNNERS = {
    "trainer": run_trainer,
    "bare": run_bare,
    "handwritten": run_handwritten,
    "trainer_hf": lambda shape, tokens, clock: run_trainer(shape, tokens, clock, hf=True),
    "trainer_factory": lambda shape, tokens, clock: run_trainer(shape, tokens, clock, factory=True),
    # XLA's own compile options instead of jaxtrain's CPU defaults (runtime/compiler.py).
    "trainer_xla_defaults": lambda shape, tokens, clock: run_trainer(
        shape, tokens, clock, compiler_options={}
    ),
}


def worker(variant: str, size: str, steps: int, warmup: int) -> None:
    start = psutil.Process().create_time()
    shape = SIZES[size]
    clock = StepClock(start, warmup, steps)
    result = RUNNERS[variant](shape, make_tokens(shape, steps), clock)
    result.update(
        variant=variant,
        size=size,
        steps=steps,
        warmup=warmup,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        minor_faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
    )
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------ the parent
EASYDEL_PYTHON_DEFAULT = "/tmp/edl/bin/python"


def worker_command(variant: str, size: str) -> list[str]:
    if variant == "cli":
        return [sys.executable, str(Path(__file__).with_name("cli_worker.py")), "--size", size]
    if variant != "easydel":
        return [sys.executable, __file__, "--worker", variant, "--size", size]
    python = os.environ.get("BENCH_EASYDEL_PYTHON", EASYDEL_PYTHON_DEFAULT)
    if not os.access(python, os.X_OK):
        sys.exit(
            f"easydel variant: no interpreter at {python} (set BENCH_EASYDEL_PYTHON); create it with"
            " `python -m venv /tmp/edl && /tmp/edl/bin/pip install easydel==0.3.0 pillow`"
        )
    return [python, str(Path(__file__).with_name("easydel_worker.py")), "--size", size]


def run_worker(variant: str, size: str, steps: int, warmup: int, env: dict | None = None) -> dict:
    cmd = worker_command(variant, size) + ["--steps", str(steps), "--warmup", str(warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT_PREFIX)]
    if proc.returncode or not lines:
        sys.exit(f"worker failed: {shlex.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def summarise(runs: list[dict], bare_runs: list[dict]) -> dict:
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    keys = ("tokens_per_s", "first_step_s", "imports_s", "setup_s", "compile_first_step_s")
    # Ratios of runs of the same repeat (adjacent in time) cancel slow drifts of the machine.
    paired = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, bare_runs)]
    return {
        **{key: med(key) for key in keys},
        "paired_ratio": statistics.median(paired),
        "paired_ratios": [round(x, 3) for x in paired],
        "tokens_per_s_runs": [round(r["tokens_per_s"]) for r in runs],
        "other_cpu_pct_max": max(r["other_cpu_pct"] + r["steal_pct"] for r in runs),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "final_loss": runs[0]["losses"][-1],
        "compile_s": runs[0].get("compile_s"),
    }


def print_table(size: str, rows: dict[str, dict]) -> None:
    bare = rows["bare"]
    print(f"\n{size}: {dataclasses.asdict(SIZES[size])}")
    cols = [
        "variant",
        "tokens/s median",
        "runs",
        "vs bare",
        "paired vs bare",
        "first step s",
        "vs bare",
        "imports s",
        "setup s",
        "compile + step 1 s",
        "peak RSS MB",
        "other CPU % (max)",
        "final loss",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for variant, r in rows.items():
        cells = [
            variant,
            f"{r['tokens_per_s']:.0f}",
            " / ".join(str(x) for x in r["tokens_per_s_runs"]),
            f"{r['tokens_per_s'] / bare['tokens_per_s']:.3f}",
            f"{r['paired_ratio']:.3f}",
            f"{r['first_step_s']:.2f}",
            f"{r['first_step_s'] / bare['first_step_s']:.2f}x",
            f"{r['imports_s']:.2f}",
            f"{r['setup_s']:.2f}",
            f"{r['compile_first_step_s']:.2f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['other_cpu_pct_max']:.1f}",
            f"{r['final_loss']:.4f}",
        ]
        print("| " + " | ".join(cells) + " |")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(x.split(":", 1)[1].strip() for x in f if x.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def parent(args: argparse.Namespace) -> None:
    command = shlex.join(["python", *sys.argv])
    print(f"command: {command}")
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; load average {os.getloadavg()}")
    print("each run: python bench/overhead.py --worker VARIANT --size SIZE --steps N --warmup W")
    if "easydel" in args.variants.split(","):
        python = worker_command("easydel", "S1")[0]  # exits now if it is missing
        print(f"easydel: {python} bench/easydel_worker.py --size SIZE --steps N --warmup W")
    print("tokens/s = batch * seq per step over steps W+1..N; first step = from process creation")
    results: dict = {
        "command": command,
        "machine": cpu_model(),
        "cpus": os.cpu_count(),
        "load_start": os.getloadavg(),
        "sizes": {},
    }
    env = None
    if args.trainer_cache == "warm":
        cache = tempfile.mkdtemp(prefix="jaxtrain-bench-xla-")
        env = {**os.environ, "BENCH_TRAINER_CACHE": cache}
        print(f"trainer compilation cache: {cache} (warmed by one run per size first)")
    for size in args.sizes.split(","):
        steps = args.steps or DEFAULT_STEPS[size]
        variants = args.variants.split(",")
        if env is not None:
            for variant in ["trainer"] + (["easydel"] if "easydel" in variants else []):
                run_worker(variant, size, steps, args.warmup, env)
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for repeat in range(args.repeats):
            order = variants if repeat % 2 == 0 else variants[::-1]  # alternate the order
            for variant in order:
                r = run_worker(variant, size, steps, args.warmup, env)
                runs[variant].append(r)
                print(
                    f"  {size} repeat {repeat} {variant}: {r['tokens_per_s']:.0f} tok/s, "
                    f"first step {r['first_step_s']:.2f}s, other CPU {r['other_cpu_pct']:.1f}%, "
                    f"steal {r['steal_pct']:.1f}%",
                    file=sys.stderr,
                    flush=True,
                )
        rows = {v: summarise(runs[v], runs["bare"]) for v in variants}
        print_table(size, rows)
        results["sizes"][size] = {"steps": steps, "warmup": args.warmup, "rows": rows, "runs": runs}
    results["load_end"] = os.getloadavg()
    print(f"\nload average at end: {results['load_end']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


def check() -> None:
    """In one process: all three variants from the same initial weights give the same losses."""
    import handwritten_llama as hw
    from flax import nnx

    from jaxtrain.models import LlamaForCausalLM

    shape, steps = SIZES["T"], DEFAULT_STEPS["T"]
    tokens = make_tokens(shape, steps)
    losses = {}
    for variant in ("trainer", "bare"):
        losses[variant] = RUNNERS[variant](shape, tokens, StepClock(time.time(), 1, steps))
    model = LlamaForCausalLM(jaxtrain_config(shape), rngs=nnx.Rngs(SEED))
    weights = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    params = hw.from_jaxtrain(weights, shape)
    clock = StepClock(time.time(), 1, steps)
    losses["handwritten"] = run_handwritten(shape, tokens, clock, params=params)
    for variant, result in losses.items():
        print(variant, [round(x, 6) for x in result["losses"]])
    reference = np.array(losses["bare"]["losses"])
    for variant in ("trainer", "handwritten"):
        np.testing.assert_allclose(losses[variant]["losses"], reference, rtol=1e-4)
    print("check passed: trainer, bare and handwritten losses agree (rtol 1e-4)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="S1,S2", help="comma-separated: S1, S2")
    p.add_argument("--steps", type=int, default=None, help="default: 30 for S1, 12 for S2")
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from tokens/s (>= 1)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--trainer-cache",
        choices=("off", "warm"),
        default="off",
        help="warm: the Trainer's (and EasyDeL's) compilation cache holds its programs (a rerun)",
    )
    p.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, with bare: {VARIANTS}"
    )
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--check", action="store_true", help="verify the variants agree, then exit")
    p.add_argument("--worker", choices=tuple(RUNNERS), help=argparse.SUPPRESS)
    p.add_argument("--size", choices=("S1", "S2"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.check:
        return check()
    sizes = [args.size] if args.worker else args.sizes.split(",")
    for size in sizes:
        if size not in ("S1", "S2"):
            raise ValueError(f"--sizes: unknown size {size!r}; use S1, S2 or S1,S2")
        steps = args.steps or DEFAULT_STEPS[size]
        if not 1 <= args.warmup < steps:
            raise ValueError(
                f"--warmup must be in [1, steps={steps}) for {size}, got {args.warmup}"
            )
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown or "bare" not in args.variants.split(","):
        raise ValueError(f"--variants: choose from {VARIANTS}, bare included; got {args.variants}")
    if args.worker:
        return worker(args.worker, args.size, args.steps or DEFAULT_STEPS[args.size], args.warmup)
    parent(args)


if __name__ == "__main__":
    main()
