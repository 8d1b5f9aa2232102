"""The engine's weights on the CPU: each projection kernel kept as its [out, in] matrix.

A decode step multiplies a few rows by every weight matrix, so it is as fast as the weights
stream from memory. XLA:CPU streams a matrix stored [out, in] into an [out, rows] product
~25% faster than the [in, out] kernel a model trains with (SmolLM2-135M's 30 layers and head
at 8 rows: 40 -> 29 ms; at 32 rows: 74 -> 61 ms; bench/RESULTS.md, session 40), so the engine
keeps that copy of each kernel (`stored_arrays`) and its steps view it as the kernel again
(`kernel_views`: a transpose XLA folds into the matmul). The model's own arrays stay as
they are: a trainer sharing the model reads and updates those, and `Engine.update_state`
copies them again. The copy costs the kernels' memory once more.

Only where it pays and is simple: on the CPU, for float kernels on one device, outside a
layer stack (`scan_layers`); every other kernel is passed as it is.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.layers import Projection, dense_in_ndim

__all__ = ["Flipped", "decode_view", "kernel_views", "stored_arrays"]

# Each flipped kernel's path in the model's state and how many leading dims are its input.
Flipped = tuple[tuple[tuple[Any, ...], int], ...]


def decode_view(model: nnx.Module) -> tuple[nnx.Module, Flipped]:
    """A view of `model` for the engine's steps (its arrays shared, not copied) whose
    projections read their kernels as [out, in] matrices, and which kernels those are. Off
    the CPU: `model` itself and none."""
    if jax.default_backend() != "cpu":
        return model, ()
    flipped = []
    for path, module in nnx.iter_graph(model):
        if isinstance(module, Projection) and _can_flip(module):
            flipped.append((tuple(path) + ("kernel",), dense_in_ndim(module.equation)))
    if not flipped:
        return model, ()
    view = nnx.clone(model)
    for path, _ in flipped:
        module = view
        for key in path[:-1]:
            module = module[key] if isinstance(key, int) else getattr(module, key)
        module.stored_transposed = True
    return view, tuple(flipped)


def _can_flip(module: Projection) -> bool:
    if not isinstance(module.kernel, nnx.Variable):  # a quantized base's codes (QLoRA)
        return False
    kernel = module.kernel.get_value()  # an array, or a shape when planning
    in_ndim = dense_in_ndim(module.equation)
    sharding = getattr(kernel, "sharding", None)
    return (
        in_ndim is not None
        and not module.fp8
        and isinstance(kernel, (jax.Array, jax.ShapeDtypeStruct))
        and jnp.issubdtype(kernel.dtype, jnp.floating)
        and kernel.ndim == len(module.equation.split(",")[1].split("-")[0])  # not stacked
        and (sharding is None or len(sharding.device_set) == 1)
    )


def _names(path: tuple) -> tuple[Any, ...]:
    keys = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return tuple(k for k in keys if k != "value")


def stored_arrays(state: Any, flipped: Flipped) -> tuple[Any, list[Any], tuple]:
    """`state`'s tree structure, its leaves with each flipped kernel [*in, *out] as its
    [out, in] matrix (a copy; shapes only for jax.ShapeDtypeStructs), and what
    `kernel_views` needs to see them as the kernels again: (leaf index, kernel shape)."""
    pairs, structure = jax.tree_util.tree_flatten_with_path(state)
    in_ndims = dict(flipped)
    leaves, views = [], []
    for index, (path, leaf) in enumerate(pairs):
        in_ndim = in_ndims.get(_names(path))
        if in_ndim is not None:
            inputs = int(np.prod(leaf.shape[:in_ndim]))
            views.append((index, tuple(leaf.shape)))
            if isinstance(leaf, jax.ShapeDtypeStruct):
                leaf = jax.ShapeDtypeStruct((leaf.size // inputs, inputs), leaf.dtype)
            else:
                leaf = leaf.reshape(inputs, -1).T  # a new array, laid out [out, in]
        leaves.append(leaf)
    return structure, leaves, tuple(views)


def kernel_views(leaves: list[Any], views: tuple) -> list[Any]:
    """Inside a step: each stored [out, in] matrix seen as its kernel again."""
    leaves = list(leaves)
    for index, shape in views:
        leaves[index] = leaves[index].T.reshape(shape)
    return leaves
