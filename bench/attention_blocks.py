"""Blockwise attention's block size on CPU: forward + backward of one layer's attention.

    PYTHONPATH=. .venv/bin/python bench/attention_blocks.py [--sizes 1024,4096,8192]
        [--blocks 128,256] [--heads 4x64/2,8x32/8] [--packed] [--rounds 3]

Each (size, heads, block) measurement runs in its own process, the variants interleaved in
rounds; a process compiles ``jax.grad`` of sum(out^2) over q, k and v, then reports the median
of three calls (``--repeats``). ``--heads NxH/K``: N query heads of width H over K key/value
heads. ``--packed``: the row holds documents of the embedded corpus's lengths (328 to 10,012
tokens, seeded), so blocks of other documents are skipped; otherwise one causal document.
Printed: seconds per block size, their median over the rounds, and each against the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Token counts of the embedded corpus's files (10th, 50th and 90th percentiles, the largest
# ones): a packed row draws its documents from these.
DOCUMENT_LENGTHS = (328, 1000, 2559, 4000, 8631, 10012)


def measure(size: int, heads: str, block: int, packed: bool, repeats: int) -> float:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxtrain.models.blockwise import blockwise_attention

    n, rest = heads.split("x")
    width, kv = (int(x) for x in rest.split("/"))
    rng = np.random.default_rng(0)
    segments = None
    if packed:
        lengths = []
        while sum(lengths) < size:
            lengths.append(int(rng.choice(DOCUMENT_LENGTHS)))
        ids = np.concatenate([np.full(length, i + 1) for i, length in enumerate(lengths)])
        segments = jnp.asarray(ids[:size][None], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, size, int(n), width)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, size, kv, width)), jnp.float32) for _ in "kv")

    def loss(q, k, v):
        out = blockwise_attention(q, k, v, segment_ids=segments, block_q=block, block_k=block)
        return (out**2).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    jax.block_until_ready(grad(q, k, v))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(grad(q, k, v))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,8192")
    parser.add_argument("--blocks", default="128,256")
    parser.add_argument("--heads", default="4x64/2,8x32/8")
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=3, metavar=("SIZE", "HEADS", "BLOCK"))
    opts = parser.parse_args()
    if opts.worker:
        size, heads, block = opts.worker
        print(json.dumps(measure(int(size), heads, int(block), opts.packed, opts.repeats)))
        return 0
    blocks = [int(b) for b in opts.blocks.split(",")]
    print(f"load {os.getloadavg()[0]:.2f}; packed={opts.packed}; XLA_FLAGS "
          f"{os.environ.get('XLA_FLAGS', '(unset)')}", flush=True)  # fmt: skip
    for heads in opts.heads.split(","):
        for size in (int(s) for s in opts.sizes.split(",")):
            seconds: dict[int, list[float]] = {b: [] for b in blocks}
            for _ in range(opts.rounds):
                for block in blocks:
                    command = [sys.executable, __file__, "--repeats", str(opts.repeats),
                               "--worker", str(size), heads, str(block)]  # fmt: skip
                    if opts.packed:
                        command.append("--packed")
                    out = subprocess.run(command, capture_output=True, text=True, check=True)
                    seconds[block].append(json.loads(out.stdout.strip().splitlines()[-1]))
            first = statistics.median(seconds[blocks[0]])
            for block in blocks:
                median = statistics.median(seconds[block])
                spread = ", ".join(f"{s:.3f}" for s in seconds[block])
                print(f"{heads:>8} T={size:>6} blocks {block:>4}: median {median:.3f} s "
                      f"({spread}); {median / first:.2f}x blocks {blocks[0]}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
