"""Where the engine's page pool lives and how many pages it holds: replicated over the model's
mesh (or on its device), sized to a memory budget or to a slot's worth of pages per slot."""

from __future__ import annotations

from typing import Any

import jax

from jaxtrain.errors import ArgumentError
from jaxtrain.serving.paged import page_bytes

__all__ = ["pool_pages", "pool_sharding"]


def pool_sharding(state: Any) -> jax.sharding.Sharding:
    """Where the page pool lives: replicated over the mesh the model's arrays are on (each
    device computes attention for the rows it holds), or on the model's device."""
    leaf = next(x for x in jax.tree.leaves(state) if getattr(x, "sharding", None) is not None)
    sharding = leaf.sharding  # an array's, or the planned one of a jax.ShapeDtypeStruct
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))


def pool_pages(
    model: Any,
    page_size: int,
    every_slot: int,
    *,
    kv_cache_gib: float | None,
    memory_fraction: float | None,
    sharding: jax.sharding.Sharding,
    routing: bool = False,
) -> int:
    """Pages of the pool (page 0, the garbage page, included): what the budget holds, never
    more than `every_slot` (a slot's worth of pages for every slot, and page 0); `routing`:
    its pages record a MoE's experts too."""
    budget = memory_budget(kv_cache_gib, memory_fraction, sharding)
    if budget is None:
        return every_slot
    return int(min(every_slot, budget // page_bytes(model, page_size, routing) + 1))


def memory_budget(
    kv_cache_gib: float | None, memory_fraction: float | None, sharding: jax.sharding.Sharding
) -> int | None:
    """Bytes the page pool may take: `kv_cache_gib`, or `memory_fraction` of the free memory
    of the device the pool lives on (GPUs and TPUs report it; CPUs do not), or None (no
    budget)."""
    if kv_cache_gib is not None and memory_fraction is not None:
        raise ArgumentError("give kv_cache_gib or memory_fraction, not both")
    if kv_cache_gib is not None:
        if not kv_cache_gib > 0:
            raise ArgumentError(f"kv_cache_gib must be > 0, got {kv_cache_gib!r}")
        return int(kv_cache_gib * 2**30)
    if memory_fraction is None:
        return None
    if not 0 < memory_fraction <= 1:
        raise ArgumentError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    device = next(iter(sharding.device_set))
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        raise ArgumentError(
            f"memory_fraction needs a device that reports its memory ({device.platform} does "
            "not); give kv_cache_gib or num_pages instead"
        )
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return int(free * memory_fraction)
