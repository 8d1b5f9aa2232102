"""An engine's memory from shapes alone: every step it compiles (warm_up.step_calls), lowered
on the parameters' shapes and the page pool's, with no array made (`jaxtrain plan`)."""

from __future__ import annotations

import time
from typing import Any

import jax
from flax import nnx
from jax.sharding import SingleDeviceSharding

from jaxtrain.observability.compiles import memory_summary
from jaxtrain.serving.decode_weights import decode_view
from jaxtrain.serving.paged import empty_pool
from jaxtrain.serving.pool import pool_sharding
from jaxtrain.serving.steps import Steps
from jaxtrain.serving.warm_up import EngineShape, step_calls

__all__ = ["plan_engine"]


def plan_engine(
    model: Any,
    shape: EngineShape,
    *,
    max_prompt_tokens: int | None = None,
    sharding: jax.sharding.Sharding | None = None,
    logprobs_mode: str = "raw",
    record_routing: bool = False,
) -> dict[str, Any]:
    """Per-device bytes of an engine of `shape` over `model` (an NNX model whose state may be
    jax.ShapeDtypeStructs): the page pool, the largest program's peak (its parameters, pool,
    outputs and temporaries) and temporaries, how many shapes it compiles, in how long.
    `sharding`: where the pool lives (default: as an engine places it, replicated over the
    parameters' mesh; the first device for unplaced shapes); `record_routing`: the pool keeps
    a MoE's experts too (Engine's option of the same name)."""
    view, flipped = decode_view(model)  # as an engine reads its weights
    graphdef, state = nnx.split(view)
    if sharding is None:
        placed = any(getattr(x, "sharding", None) is not None for x in jax.tree.leaves(state))
        sharding = pool_sharding(state) if placed else SingleDeviceSharding(jax.devices()[0])
    pool = jax.eval_shape(lambda: empty_pool(model, shape.pages, shape.page_size, record_routing))
    pool = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), pool)
    steps = Steps(graphdef, shape.page_size, sharding, "gather", logprobs_mode == "processed",
                  shape.decode_steps, flipped)  # fmt: skip
    platform = next(iter(sharding.device_set)).platform
    start, peaks, temporaries, shapes = time.perf_counter(), [], [], {}
    for kind, args in step_calls(shape, max_prompt_tokens):
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
        memory = memory_summary(steps.lower(kind, state, pool, *abstract).compile(), platform)
        shapes[kind] = shapes.get(kind, 0) + 1
        if memory is not None:
            peaks.append(memory["peak"])
            temporaries.append(memory["temporaries"])
    pool_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))
    return {
        "pool_bytes": float(pool_bytes),
        "peak": max(peaks, default=0.0),
        "temporaries": max(temporaries, default=0.0),
        "shapes": shapes,
        "compile_seconds": time.perf_counter() - start,
    }
