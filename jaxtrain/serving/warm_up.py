"""Compiling every step shape an engine can reach before its first request, so that serving
and GRPO rounds compile nothing. Each call writes only the garbage page: every row of a
prefill is padding, every row of a decode step idle."""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import numpy as np

from jaxtrain.serving.sampling import sampling_arrays
from jaxtrain.serving.steps import (
    PREFILL_GROWTH,
    SMALLEST_PREFILL,
    SMALLEST_TABLE,
    buckets,
    chunk_tokens,
    table_width,
)

__all__ = ["compile_every_bucket"]


def compile_every_bucket(engine: Any, max_prompt_tokens: int | None = None) -> int:
    """Compile the engine's prefill shapes for prompts up to `max_prompt_tokens` (default
    max_length; every length when the pool can preempt, since a preempted sequence comes back
    as a longer prompt), and every decode (and speculative) shape; returns how many shapes
    were compiled. `engine`: a serving.Engine (not imported: it calls this)."""
    e = engine
    longest = min(max_prompt_tokens or e.max_length, e.max_length)
    if e.pages.num_pages - 1 < e.max_slots * e.max_pages:
        longest = e.max_length
    rows = buckets(1, e.max_slots)
    tokens = buckets(SMALLEST_PREFILL, max(SMALLEST_PREFILL, e.prefill_tokens), PREFILL_GROWTH)
    widest = table_width(math.ceil(longest / e.page_size), e.max_pages, PREFILL_GROWTH)
    widths = [w for w in buckets(SMALLEST_TABLE, e.max_pages, PREFILL_GROWTH) if w <= widest]
    before = sum(len(shapes) for shapes in e.steps.compiles.values())
    zeros = np.zeros(e.max_slots, np.int32)
    for r, t, width in itertools.product(rows, tokens, widths):
        if (r > 1 and r * t > e.prefill_tokens) or t > chunk_tokens(longest, e.prefill_tokens):
            continue  # a chunk never has this shape
        _, e.pool = e.steps.prefill(
            e.state, e.pool, np.zeros((r, t), np.int32), np.zeros(r, np.int32),
            np.zeros((r, width), np.int32), np.full(r, t, np.int32), zeros, zeros,
            *sampling_arrays([], [], e.max_slots),
        )  # fmt: skip
    for r, width in itertools.product(rows, buckets(SMALLEST_TABLE, e.max_pages)):
        idle = (np.zeros(r, np.int32), np.zeros((r, width), np.int32))
        _, e.pool = e.steps.decode(
            e.state, e.pool, np.zeros((r, 1), np.int32), *idle, *sampling_arrays([], [], r)
        )
        if e.speculative_tokens:
            *_, e.pool = e.steps.verify(
                e.state, e.pool, np.zeros((r, 1 + e.speculative_tokens), np.int32), *idle,
                np.zeros(r, np.int32), *sampling_arrays([], [], r),
            )  # fmt: skip
    e.pool = e.steps.copy_page(e.pool, 0, 0)  # a group's partial page, copied for its samples
    jax.block_until_ready(e.pool)
    return sum(len(shapes) for shapes in e.steps.compiles.values()) - before
