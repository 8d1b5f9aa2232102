"""A CPU decode step's attention by page-table width: the gathered attention of 32 rows under
a scan of 30 layers of SmolLM2-135M's shapes (9 query heads, 3 kv heads of 64, pages of 16
tokens, float32 pools of random keys and values), row groups gathering all of the table
(`--widths 1`) or as little as their longest row needs (4 or 8 widths, paged.py's
CPU_DECODE_WIDTHS).

    PYTHONPATH=. .venv/bin/python bench/decode_attention.py [--widths 1,4] [--rounds 3] \
        [--cases 40-240x16,170-180x16,100-120x32,400-500x32]

A case `LO-HIxW`: rows whose next tokens sit at positions spread evenly from LO to HI, in a
W-page table. Each (case, widths) runs in its own process, the order alternating between
rounds; a worker compiles (timed), then times 5 x 10 calls and reports their median ms. Printed:
medians with (min-max) over rounds, the machine's other load while timed, and each variant's
ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import cpu_sample  # noqa: E402

RESULT = "DECODE_ATTENTION "
ROWS, HEADS, KV_HEADS, DIM, PAGE, LAYERS = 32, 9, 3, 64, 16, 30


def worker(case: str, widths: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxtrain.serving import paged

    paged.CPU_DECODE_WIDTHS = widths  # read when the step is traced
    span, width = case.split("x")
    low, high, width = *map(int, span.split("-")), int(width)
    rng = np.random.default_rng(0)
    pages = ROWS * width + 1
    keys, values = (jnp.asarray(rng.normal(size=(KV_HEADS, pages, PAGE, DIM)), jnp.float32)
                    for _ in range(2))  # fmt: skip
    q = jnp.asarray(rng.normal(size=(ROWS, 1, HEADS, DIM)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, pages)).reshape(ROWS, width))
    start = jnp.asarray(rng.permutation(np.linspace(low, high, ROWS).round().astype(np.int32)))

    @jax.jit
    def layers(q, keys, values):
        slots = paged.PagedSlots.of(start, 1, table, PAGE, row_group=paged.CPU_DECODE_ROWS)

        def layer(carry, _):
            return carry + slots.attention(q + carry, keys, values, slots.mask()), None

        return jax.lax.scan(layer, jnp.zeros_like(q), None, length=LAYERS)[0]

    began = time.perf_counter()
    jax.block_until_ready(layers(q, keys, values))
    compile_s = time.perf_counter() - began
    times, busy0 = [], cpu_sample()
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(10):
            jax.block_until_ready(layers(q, keys, values))
        times.append((time.perf_counter() - began) / 10 * 1000)
    busy1 = cpu_sample()
    wall = sum(times) * 10 / 1000
    other = max(0.0, (busy1[0] - busy0[0]) - (busy1[2] - busy0[2])) / wall / os.cpu_count()
    return dict(ms=statistics.median(times), compile_s=compile_s, other_load=other)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default="40-240x16,170-180x16,100-120x32,400-500x32")
    parser.add_argument("--worker", nargs=2, metavar=("CASE", "WIDTHS"))
    opts = parser.parse_args()
    if opts.worker:
        print(RESULT + json.dumps(worker(opts.worker[0], int(opts.worker[1]))))
        return 0
    variants = [int(w) for w in opts.widths.split(",")]
    print(f"command: python {' '.join(sys.argv)}; load {os.getloadavg()}")
    for case in opts.cases.split(","):
        runs: dict[int, list[dict]] = {w: [] for w in variants}
        for r in range(opts.rounds):
            for w in variants if r % 2 == 0 else variants[::-1]:
                argv = [sys.executable, __file__, "--worker", case, str(w)]
                out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
                runs[w].append(json.loads(out.split(RESULT)[-1]))
        first = statistics.median(x["ms"] for x in runs[variants[0]])
        for w, results in runs.items():
            ms = [x["ms"] for x in results]
            median = statistics.median(ms)
            print(f"{case} widths={w}: {median:.1f} ms ({min(ms):.1f}-{max(ms):.1f}) a step's "
                  f"attention, x{median / first:.2f}; compile "
                  f"{statistics.median(x['compile_s'] for x in results):.2f} s; other load "
                  f"{max(x['other_load'] for x in results):.0%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
