"""Generation speed: KV cache vs the cache-free loop, on the demo model.

    .venv/bin/python bench/generation.py                      # ~1-2 minutes on 2 cores
    .venv/bin/python bench/generation.py --prompt 64 --new 256 --rounds 3 --batch 1
    .venv/bin/python bench/generation.py --family gemma       # or gpt2: the demo's shape

The demo model (jaxtrain.cli.run_config.DEFAULT_CONFIG, vocab 4096, random weights) generates
``--new`` tokens after a ``--prompt``-token prompt, greedy, no eos, with
``generate(use_cache=True)`` and ``generate(use_cache=False)`` (the generate() before issue 12).
``--family gemma`` / ``gpt2`` builds a Gemma 2 (sliding window 128 on every other layer,
soft-capping) or a GPT-2 of the same width, depth and vocabulary instead.
Each variant is compiled once first; the rounds then alternate the two variants and time
the whole call (prefill included). Prints tokens/s per variant, the median of the per-round
ratios, and whether the greedy tokens are identical.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from flax import nnx

from jaxtrain.cli.run_config import DEFAULT_CONFIG
from jaxtrain.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, generate
from jaxtrain.models.gemma import GemmaConfig, GemmaForCausalLM


def demo_model(family: str) -> nnx.Module:
    """The demo model's shape (DEFAULT_CONFIG, vocab 4096) in `family`, random weights."""
    shape = {**DEFAULT_CONFIG["model"], "vocab_size": 4096}
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape), rngs=nnx.Rngs(0))
    if family == "gemma":
        config = GemmaConfig(
            **shape, sliding_window=128, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
        )
        return GemmaForCausalLM(config, rngs=nnx.Rngs(0))
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "max_position_embeddings")  # fmt: skip
    return GPT2LMHeadModel(GPT2Config(**{k: shape[k] for k in keys}), rngs=nnx.Rngs(0))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--family", choices=("llama", "gemma", "gpt2"), default="llama")
    opts = parser.parse_args()
    model = demo_model(opts.family)
    prompt = np.random.default_rng(0).integers(0, 4096, (opts.batch, opts.prompt))

    def run(use_cache: bool) -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        out = generate(model, prompt, max_new_tokens=opts.new, use_cache=use_cache)
        return time.perf_counter() - start, out

    compile_s = {}
    outputs = {}
    for use_cache in (True, False):
        compile_s[use_cache], outputs[use_cache] = run(use_cache)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(opts.rounds):
        for use_cache in (True, False) if r % 2 == 0 else (False, True):
            times[use_cache].append(run(use_cache)[0])
    tokens = opts.batch * opts.new
    print(f"demo model ({opts.family}), batch {opts.batch}, prompt {opts.prompt}, {opts.new} new tokens, "
          f"{opts.rounds} rounds")  # fmt: skip
    print("| variant | tokens/s (median) | runs s | first call s (compile) |")
    print("| --- | --- | --- | --- |")
    for use_cache, name in ((True, "KV cache"), (False, "no cache (before)")):
        runs = " / ".join(f"{t:.2f}" for t in times[use_cache])
        rate = tokens / statistics.median(times[use_cache])
        print(f"| {name} | {rate:.0f} | {runs} | {compile_s[use_cache]:.2f} |")
    ratio = statistics.median(b / a for a, b in zip(times[True], times[False]))
    same = np.array_equal(outputs[True], outputs[False])
    print(f"\nspeed-up (median of rounds): {ratio:.1f}x; identical greedy tokens: {same}")


if __name__ == "__main__":
    main()
