"""XLA:CPU flags against the time a test pays: eager ops, a model build, a step's compile.

    python bench/compile_flags.py [--rounds 3]

The test suite is mostly compiles (tests/conftest.py sets its XLA_FLAGS from these figures).
Every variant runs in its OWN process (`--worker FLAGS`, XLA_FLAGS read at jax's import),
rounds interleaved with the order rotated per round; the table gives medians and ranges.
What a worker times, on a test-sized Llama (hidden 64, 2 layers, vocab 256, 4 x 64 tokens):
- eager: 60 elementwise ops on arrays of 60 shapes (each compiles a program of its own, as a
  test's eager code does);
- build: `LlamaForCausalLM(...)` outside jit (one random-normal program per parameter shape);
- compile: `jit(value_and_grad + adamw).lower(...).compile()` of one train step;
- step: the median of 20 steps after 2, the cost of a slower program in a longer test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "xla_default": "",
    "level1": "--xla_backend_optimization_level=1",
    "level0": "--xla_backend_optimization_level=0",
    "legacy_level1": "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false",
    "suite": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
}
FIGURES = ("eager_s", "build_s", "compile_s", "step_ms")


def worker() -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxtrain.models import LlamaConfig, LlamaForCausalLM

    out = {}
    arrays = [jnp.ones((i + 1, 3)) for i in range(60)]
    start = time.perf_counter()
    for x in arrays:
        (x * 2.0 + 1.0).block_until_ready()
    out["eager_s"] = time.perf_counter() - start

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    start = time.perf_counter()
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    jax.block_until_ready(params)
    out["build_s"] = time.perf_counter() - start

    optimizer = optax.adamw(1e-3)
    tokens = jnp.asarray(
        jax.random.randint(jax.random.key(0), (4, 65), 0, 256), jnp.int32
    ).block_until_ready()

    def step(params, opt_state, tokens):
        def loss(p):
            logits = nnx.merge(graphdef, p)(tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = optimizer.init(params)
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()
    out["compile_s"] = time.perf_counter() - start
    times = []
    for i in range(22):
        start = time.perf_counter()
        params, opt_state, value = compiled(params, opt_state, tokens)
        value.block_until_ready()
        if i >= 2:
            times.append(time.perf_counter() - start)
    out["step_ms"] = 1000 * statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    names = list(VARIANTS)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            env = {**os.environ, "XLA_FLAGS": VARIANTS[name], "JAX_PLATFORMS": "cpu"}
            env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every compile is a compile
            done = subprocess.run([sys.executable, __file__, "--worker"], env=env,
                                  capture_output=True, text=True, check=True)  # fmt: skip
            results[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{args.rounds} done, load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"{'variant':12s}" + "".join(f"{f:>24s}" for f in FIGURES))
    for name in names:
        cells = []
        for f in FIGURES:
            values = [x[f] for x in results[name]]
            cells.append(f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})")
        print(f"{name:12s}" + "".join(f"{c:>24s}" for c in cells))
    base = {f: statistics.median(x[f] for x in results["level1"]) for f in FIGURES}
    for name in names:
        ratios = [statistics.median(x[f] for x in results[name]) / base[f] for f in FIGURES]
        print(
            f"{name:12s} / level1: " + ", ".join(f"{f} {r:.2f}x" for f, r in zip(FIGURES, ratios))
        )


if __name__ == "__main__":
    main()
