"""Every step shape an engine can reach, compiled before its first request so that serving
and GRPO rounds compile nothing (`compile_every_bucket`), or compiled from shapes alone by
`jaxtrain plan` (serving/plan.py). Each warm-up call writes only the garbage page: every row
of a prefill is padding, every row of a decode step idle."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import numpy as np

from jaxtrain.serving.sampling import sampling_arrays
from jaxtrain.serving.steps import (
    PREFILL_GROWTH,
    SMALLEST_PREFILL,
    bucket,
    buckets,
    chunk_tokens,
    smallest_table,
    table_width,
)

__all__ = ["EngineShape", "compile_every_bucket", "step_calls"]


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What an engine's compiled shapes depend on (serving.Engine's arguments of the same
    names; `num_pages` None: a slot's worth of pages for every slot, and the garbage page)."""

    max_slots: int
    page_size: int
    max_length: int
    num_pages: int | None = None
    prefill_tokens: int = 512
    speculative_tokens: int = 0
    decode_steps: int = 1
    # A vision-language model's prefill calls that write images: (max_images, (C, H, W)).
    images: tuple[int, tuple[int, ...]] | None = None

    @property
    def max_pages(self) -> int:
        return math.ceil(self.max_length / self.page_size)

    @property
    def pages(self) -> int:
        return self.num_pages or self.max_slots * self.max_pages + 1


def step_calls(
    shape: EngineShape, max_prompt_tokens: int | None = None, max_prefill_rows: int | None = None
) -> list[tuple[str, tuple]]:
    """(step, its arguments after the state and the pool) of every shape an engine of `shape`
    can call, for prompts up to `max_prompt_tokens` (default max_length; every length when
    the pool can preempt, since a preempted sequence comes back as a longer prompt), at most
    `max_prefill_rows` of them waiting at once (default max_slots: a prefill call takes the
    waiting prompts; GRPO knows how many it submits)."""
    s, growth = shape, PREFILL_GROWTH
    longest = min(max_prompt_tokens or s.max_length, s.max_length)
    if s.pages - 1 < s.max_slots * s.max_pages:
        longest = s.max_length
    waiting = min(max_prefill_rows or s.max_slots, s.max_slots)
    rows = buckets(1, s.max_slots)
    prefill_rows = [r for r in rows if r < waiting] + [bucket(waiting, 1, s.max_slots)]
    tokens = buckets(SMALLEST_PREFILL, max(SMALLEST_PREFILL, s.prefill_tokens), growth)
    widest = table_width(math.ceil(longest / s.page_size), s.max_pages, s.page_size, growth)
    widths = [w for w in buckets(smallest_table(s.page_size), s.max_pages, growth) if w <= widest]
    zeros = np.zeros(s.max_slots, np.int32)
    calls = []
    for r, t, width in itertools.product(prefill_rows, tokens, widths):
        if (r > 1 and r * t > s.prefill_tokens) or t > chunk_tokens(longest, s.prefill_tokens):
            continue  # a chunk never has this shape
        args = (np.zeros((r, t), np.int32), np.zeros(r, np.int32), np.zeros((r, width), np.int32),
                np.full(r, t, np.int32), np.zeros(r, np.int32), zeros, zeros)  # fmt: skip
        sampling = sampling_arrays([], [], s.max_slots)
        calls.append(("prefill", (*args, *sampling)))
        if s.images is not None:
            pixels = np.zeros((r, s.images[0], *s.images[1]), np.float32)
            calls.append(("prefill_images", (*args, pixels, *sampling)))
    for r, width in itertools.product(rows, buckets(smallest_table(s.page_size), s.max_pages)):
        idle = (np.zeros(r, np.int32), np.zeros((r, width), np.int32), np.zeros(r, np.int32))
        sampling = sampling_arrays([], [], r)
        calls.append(("decode", (np.zeros((r, 1), np.int32), *idle, *sampling)))
        if s.decode_steps > 1:
            ids = np.zeros((r, 1), np.int32)
            calls.append(("decode_many", (ids, *idle, np.zeros(r, np.int32), *sampling)))
        if s.speculative_tokens:
            ids = np.zeros((r, 1 + s.speculative_tokens), np.int32)
            calls.append(("verify", (ids, *idle, np.zeros(r, np.int32), *sampling)))
    return calls


def compile_every_bucket(
    engine: Any, max_prompt_tokens: int | None = None, max_prefill_rows: int | None = None
) -> int:
    """Compile every shape of `step_calls` on `engine` (a serving.Engine, not imported: it
    calls this); returns how many shapes were compiled."""
    e = engine
    images = None if e.images is None else (e.images.max_images, e.images.shape)
    shape = EngineShape(e.max_slots, e.page_size, e.max_length, e.pages.num_pages,
                        e.prefill_tokens, e.speculative_tokens, e.decode_steps,
                        images)  # fmt: skip
    before = sum(len(shapes) for shapes in e.steps.compiles.values())
    for kind, args in step_calls(shape, max_prompt_tokens, max_prefill_rows):
        *_, e.pool = getattr(e.steps, kind)(e.params, e.pool, *args)
    e.pool = e.steps.copy_page(e.pool, 0, 0)  # a group's partial page, copied for its samples
    if e.record_routing:  # a finished sequence's experts, read back
        e.steps.routing(e.pool, [], e.max_pages)
    jax.block_until_ready(e.pool)
    return sum(len(shapes) for shapes in e.steps.compiles.values()) - before
