"""Batch placement: rows over (dp, fsdp), sequence over sp; each host feeds only its rows.

Train batches are [A, M, T, ...] (A micro-batches of M rows), eval batches [B, T, ...]. A
host's loader yields its [A, M / processes, T] slice and `to_global` assembles the global
array with `jax.make_array_from_process_local_data`: no host ever holds the global batch.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config.tables import check_divisible
from jaxtrain.parallel.mesh import BATCH_AXES, SEQUENCE_AXIS


class BatchLayout:
    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.batch_axes = tuple(a for a in BATCH_AXES if mesh.shape[a] > 1)
        self.seq_axis = SEQUENCE_AXIS if mesh.shape[SEQUENCE_AXIS] > 1 else None
        self.batch_shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
        self.seq_shards = mesh.shape[SEQUENCE_AXIS]
        self.process_count = jax.process_count()

    def check(self, rows: int, seq_len: int, what: str) -> None:
        """Fail early when `rows` or `seq_len` cannot be split over the mesh."""
        hint = " (or change sharding_axis_dims)"
        check_divisible(rows, self.batch_shards, what=what, over="dp*fsdp", hint=hint)
        check_divisible(seq_len, self.seq_shards, what="max_sequence_length", over="sp", hint=hint)

    def spec(self, ndim: int, *, micro_axis: bool) -> P:
        batch = self.batch_axes if len(self.batch_axes) != 1 else self.batch_axes[0]
        lead = [None] if micro_axis else []
        dims = [*lead, batch or None, self.seq_axis]
        dims = dims[:ndim] + [None] * (ndim - len(dims))
        return P(*dims)

    def sharding(self, ndim: int, *, micro_axis: bool) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(ndim, micro_axis=micro_axis))

    def shardings(self, batch: dict[str, Any], *, micro_axis: bool) -> dict[str, NamedSharding]:
        return {k: self.sharding(np.ndim(v), micro_axis=micro_axis) for k, v in batch.items()}

    def to_global(self, local: dict[str, np.ndarray], *, micro_axis: bool) -> dict[str, jax.Array]:
        """Assemble this host's rows into global arrays placed on the mesh."""
        row_axis = 1 if micro_axis else 0
        out = {}
        for key, value in local.items():
            value = np.asarray(value)
            shape = list(value.shape)
            if value.ndim > row_axis:  # leaves without a row axis are the same on every host
                shape[row_axis] *= self.process_count
            sharding = self.sharding(value.ndim, micro_axis=micro_axis)
            out[key] = jax.make_array_from_process_local_data(sharding, value, tuple(shape))
        return out
