"""Optimizer state sharded like the parameters (ZeRO-style).

Optax states embed copies of the parameter tree (Adam's mu/nu, momentum, ...). A state leaf
whose key path ends with a parameter's path and has that parameter's shape gets the
parameter's sharding; everything else (step counts, scalars, factored statistics) is
replicated. No state leaf is ever larger than its parameter, so with fsdp the optimizer
state per device shrinks by the fsdp size like the parameters do.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.pytrees import path_str


def _keys(path: Any) -> tuple[str, ...]:
    text = path_str(path)
    return tuple(text.split("/")) if text else ()


def optimizer_shardings(
    abstract_opt_state: Any, abstract_params: Any, param_shardings: Any, mesh: Mesh
) -> Any:
    """Shardings shaped like `abstract_opt_state` (from jax.eval_shape(optimizer.init, ...))."""
    known: dict[tuple[str, ...], tuple[tuple[int, ...], NamedSharding]] = {}
    params_with_paths = jax.tree_util.tree_leaves_with_path(abstract_params)
    shardings = jax.tree.leaves(param_shardings)
    for (path, leaf), sharding in zip(params_with_paths, shardings, strict=True):
        known[_keys(path)] = (tuple(leaf.shape), sharding)
    replicated = NamedSharding(mesh, P())

    def pick(path: Any, leaf: Any) -> NamedSharding:
        keys = _keys(path)
        shape = tuple(getattr(leaf, "shape", ()))
        for start in range(len(keys)):
            hit = known.get(keys[start:])
            if hit is not None and hit[0] == shape:
                return hit[1]
        return replicated

    return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)
