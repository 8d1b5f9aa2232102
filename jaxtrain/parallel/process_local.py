"""What one process of a multi-host run computes on its own devices, without its peers.

Work that differs between processes (GRPO's rollouts: each process generates its own prompts'
completions, for as many steps as they take) cannot run on the global mesh: every program
there is a collective all processes must enter together. `process_local_state` gathers each
array of a model's state once (a collective every process enters at the same point) and
keeps this process's copy on its own devices, sharded over the process's block of the mesh
the way the global array was over the whole mesh. `gather_from_processes` brings every
process's share of some host rows to all of them (`gather_shares` when shares differ).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "gather_from_processes",
    "gather_micro_batch_shares",
    "gather_shares",
    "micro_batch_share",
    "process_block",
    "process_local_mesh",
    "process_local_state",
]


def process_local_mesh(mesh: Mesh) -> Mesh:
    """The block of `mesh` whose devices belong to this process, with the same axis names
    (hosts split only the batch axes, so it is a block); otherwise the process's devices
    along the first axis."""
    grid = mesh.devices
    mine = np.vectorize(lambda d: d.process_index == jax.process_index())(grid)
    box = tuple(slice(int(i.min()), int(i.max()) + 1) for i in np.nonzero(mine))
    block = grid[box]
    if block.size != int(mine.sum()):
        local = np.array(jax.local_devices(), dtype=object)
        block = local.reshape(len(local), *([1] * (grid.ndim - 1)))
    return Mesh(block, mesh.axis_names, axis_types=mesh.axis_types)


def _local_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """`spec` on `mesh`, each dimension replicated where the block's axes do not divide it."""
    dims = []
    for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        ways = math.prod(mesh.shape[a] for a in names)
        dims.append(axes if names and size % ways == 0 else None)
    return P(*dims)


@functools.cache
def _replicate(sharding: NamedSharding) -> Any:
    return jax.jit(lambda x: x, out_shardings=sharding)


def _local_copy(x: Any, local: Mesh) -> Any:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    sharding = x.sharding
    everywhere = _replicate(NamedSharding(sharding.mesh, P()))(x)  # a collective: all enter
    order = {d: i for i, d in enumerate(local.devices.flat)}
    shards = sorted(everywhere.addressable_shards, key=lambda s: order[s.device])
    whole = jax.make_array_from_single_device_arrays(
        x.shape, NamedSharding(local, P()), [s.data for s in shards]
    )
    spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
    return jax.device_put(whole, NamedSharding(local, _local_spec(spec, x.shape, local)))


def process_local_state(state: Any, mesh: Mesh) -> Any:
    """`state` (a pytree of global arrays on `mesh`) as arrays on this process's devices
    only. Every process must call it at the same point (it gathers); one leaf at a time,
    so a device holds at most one whole array beyond its shards."""
    local = process_local_mesh(mesh)
    return jax.tree.map(lambda x: _local_copy(x, local), state)


def gather_from_processes(local: np.ndarray) -> np.ndarray:
    """[processes, *local.shape]: every process's `local` (same shape on each), in process
    order, on every process, bit-exact (float64 too). One process: `local[None]`."""
    local = np.ascontiguousarray(local)
    if jax.process_count() == 1:
        return local[None]
    # As bytes: JAX without x64 would otherwise carry float64 and int64 as 32 bits.
    raw = local.reshape(-1).view(np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(raw, tiled=False))
    return gathered.view(local.dtype).reshape(-1, *local.shape)


def gather_shares(local: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Every process's `local` rows (process p holds `sizes[p]` of them, shares of different
    sizes padded for the gather) concatenated in process order, on every process."""
    if jax.process_count() == 1:
        return local
    padded = np.zeros((max(sizes), *local.shape[1:]), local.dtype)
    padded[: len(local)] = local
    every = gather_from_processes(padded)
    return np.concatenate([rows[:n] for rows, n in zip(every, sizes)])


def micro_batch_share(
    rows: np.ndarray, accumulation: int, index: int, count: int, *, micro_axis: bool = False
) -> np.ndarray:
    """Process `index` of `count`'s share of a step's rows ([N, ...] in batch order, or
    [A, M, ...] with `micro_axis`, A = `accumulation`): its contiguous block of every
    micro-batch, as the batch layout places them. One process: all of them."""
    if count == 1:
        return rows
    shaped = rows if micro_axis else rows.reshape(accumulation, -1, *rows.shape[1:])
    share = shaped.shape[1] // count
    mine = shaped[:, index * share : (index + 1) * share]
    return mine if micro_axis else mine.reshape(-1, *rows.shape[1:])


def gather_micro_batch_shares(local: np.ndarray, accumulation: int, count: int) -> np.ndarray:
    """The step's rows [N, ...] in batch order from the `micro_batch_share` of each of the
    `count` processes."""
    if count == 1:
        return local
    every = gather_from_processes(local.reshape(accumulation, -1, *local.shape[1:]))
    return np.concatenate(list(every), axis=1).reshape(-1, *local.shape[1:])  # [P, A, M/P]


def process_block(x: jax.Array) -> np.ndarray:
    """The block of a global array this process holds (its shards put together; replicas
    read once): the whole array when one process holds it all."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = {}
    for shard in x.addressable_shards:
        start = tuple(s.start or 0 for s in shard.index)
        shards.setdefault(start, shard.data)
    origin = np.min(list(shards), axis=0)
    ends = np.max([np.add(start, data.shape) for start, data in shards.items()], axis=0)
    block = np.empty(tuple(ends - origin), x.dtype)
    for start, data in shards.items():
        at = tuple(slice(b - o, b - o + n) for b, o, n in zip(start, origin, data.shape))
        block[at] = np.asarray(data)
    return block
