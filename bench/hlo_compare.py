"""Compare the compiled train-step gradients of jaxtrain's Llama and the hand-written one.

    PYTHONPATH=. python bench/hlo_compare.py [--size S1|S2]

Prints, for each model, what XLA's optimized HLO holds: ops by kind (fusions, copies,
transposes, dots, cos/sin), the FLOPs and bytes XLA's cost analysis reports. Used to find
where jaxtrain's step did more memory work than the hand-written one (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import handwritten_llama as hw  # noqa: E402 - bench/ is not a package
from measure import SIZES  # noqa: E402
from overhead import jaxtrain_loss  # noqa: E402

KINDS = ("fusion", "copy", "transpose", "dot", "cosine", "sine")


def describe(name: str, loss, params, ids) -> None:
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, ids).compile()
    ops = collections.Counter(re.findall(r"= \S+ ([a-z-]+)\(", compiled.as_text()))
    cost = compiled.cost_analysis()
    counts = ", ".join(f"{k} {ops[k]}" for k in KINDS)
    print(
        f"{name}: {counts}; {cost['flops'] / 1e9:.1f} GFLOP, {cost['bytes accessed'] / 1e6:.0f} MB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="S1", choices=["S1", "S2"])
    shape = SIZES[parser.parse_args().size]
    ids = jnp.zeros((shape.batch, shape.seq), jnp.int32)
    describe("jaxtrain", *jaxtrain_loss(shape), ids)
    hand = hw.init_params(jax.random.key(0), shape)
    describe("handwritten", lambda p, i: hw.next_token_loss(p, i, shape), hand, ids)


if __name__ == "__main__":
    main()
