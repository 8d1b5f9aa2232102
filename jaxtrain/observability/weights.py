"""Weight statistics: mean, std, min, max and L2 norm per parameter group, plus a histogram.

A group is one kind of parameter across layers: the parameter path with layer indices
replaced by "all" (e.g. "model/layers/all/mlp/down_proj/kernel"), so a 32-layer model logs ten
groups, not three hundred. Everything is computed on device by one jitted function; only the
few numbers per group (and 64 histogram counts) travel to the host.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HISTOGRAM_BINS = 64


def group_name(path: tuple[Any, ...]) -> str:
    parts = []
    for key in path:
        name = str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
        if name == "value":
            continue
        parts.append("all" if re.fullmatch(r"\d+", name) else name)
    return "/".join(parts)


def parameter_groups(params: Any) -> dict[str, list[int]]:
    """{group name: indices of the params' leaves in that group}, in leaf order."""
    groups: dict[str, list[int]] = {}
    for index, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        groups.setdefault(group_name(path), []).append(index)
    return groups


def _group_stats(values: list[jax.Array]) -> dict[str, jax.Array]:
    x = jnp.concatenate([v.astype(jnp.float32).ravel() for v in values])
    count = x.size
    mean = x.sum() / count
    lo, hi = x.min(), x.max()
    width = jnp.maximum(hi - lo, 1e-12)
    bins = jnp.clip(((x - lo) / width * HISTOGRAM_BINS).astype(jnp.int32), 0, HISTOGRAM_BINS - 1)
    sum_sq = jnp.sum(x * x)
    return {
        "mean": mean,
        "std": jnp.sqrt(jnp.mean((x - mean) ** 2)),
        "min": lo,
        "max": hi,
        "norm": jnp.sqrt(sum_sq),
        "sum": x.sum(),
        "sum_sq": sum_sq,
        "count": jnp.asarray(count, jnp.float32),
        "hist_counts": jnp.bincount(bins, length=HISTOGRAM_BINS),
    }


def make_weight_stats_fn(params: Any) -> Callable[[Any], dict[str, dict[str, jax.Array]]]:
    """A pure function params -> {group: stats}; jit it."""
    groups = parameter_groups(params)

    def stats(params: Any) -> dict[str, dict[str, jax.Array]]:
        leaves = jax.tree.leaves(params)
        return {name: _group_stats([leaves[i] for i in idx]) for name, idx in groups.items()}

    return stats


def scalar_logs(stats: dict[str, dict[str, Any]]) -> dict[str, float]:
    """{"weights/<group>/<stat>": value} for mean, std, min, max and norm."""
    return {
        f"weights/{group}/{key}": float(values[key])
        for group, values in stats.items()
        for key in ("mean", "std", "min", "max", "norm")
    }


def histogram(values: dict[str, Any]) -> dict[str, Any]:
    """One group's histogram in the fields TensorBoard's raw histogram takes."""
    lo, hi = float(values["min"]), float(values["max"])
    edges = np.linspace(lo, hi, HISTOGRAM_BINS + 1)
    return {
        "min": lo,
        "max": hi,
        "num": float(values["count"]),
        "sum": float(values["sum"]),
        "sum_squares": float(values["sum_sq"]),
        "bucket_limits": edges[1:].tolist(),
        "bucket_counts": np.asarray(values["hist_counts"]).astype(float).tolist(),
    }
