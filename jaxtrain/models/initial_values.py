"""Random-normal initial weights, drawn eagerly with few compiled programs.

A model built outside jit draws each parameter eagerly, and on XLA each new shape is a program
of its own to compile: tens of milliseconds each, most of a small model's build. Threefry
draws are partitionable (jax's default, `jax_threefry_partitionable`): a value depends on the
key and its flat index alone, so the first n values of a draw of m >= n numbers are the draw
of n numbers, in any shape. On the CPU one program per size class (the size rounded up to an
eighth of its power of two; and per standard deviation and dtype) therefore draws every
parameter up to `SHARED_DRAW_MAX` values, and numpy cuts and shapes its part, copied into an
array of its own: the same bits as a draw of the parameter's own shape, from a handful of draw
programs per model instead of one per shape.
Elsewhere, and inside a trace (a ModelFactory's init), each draw has its own shape.

The standard deviation is a constant of the program, as it is in a traced init (a sharded
build inside jit), so an eager build and a traced one agree to the bit. flax's normal
initializer, run eagerly, multiplies in an eager op of its own and differs from its traced self
in the last bit; the models draw here instead.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.config.tables import cpu_defaults

Array = jax.Array

# The largest draw that shares a program. A draw takes ~13 ms per million values here and a
# compile ~150 ms, and every layer pays its parameters' padding while a shape compiles once:
# larger parameters (a big model's matrices) draw their own shape, with no padding or copy.
SHARED_DRAW_MAX = 1 << 20


def size_class(size: int) -> int:
    """`size` rounded up to a multiple of an eighth of its power of two: under 12.5% padding,
    eight classes an octave."""
    step = 1 << max(size.bit_length() - 4, 0)
    return -(-size // step) * step


def _draw(key: Array, *, shape: tuple[int, ...], std: float, dtype: Any) -> Array:
    return jax.random.normal(key, shape, dtype) * jnp.array(std, dtype)


# At the Trainer's CPU level (config/tables.py): a 37.8M model's build took 1.9 s at XLA's
# default level, 1.0 s at level 1; level 0 compiles faster but draws slower.
_compiled_draw = jax.jit(
    _draw, static_argnames=("shape", "std", "dtype"), compiler_options=cpu_defaults() or None
)


def _prefix_stable(key: Array) -> bool:
    """Whether a longer draw from `key` starts with the shorter one (partitionable threefry),
    on the CPU, where cutting it in numpy costs no transfer."""
    return (
        bool(jax.config.jax_threefry_partitionable)
        and str(jax.random.key_impl(key)) == "threefry2x32"
        and all(device.platform == "cpu" for device in key.devices())
    )


def draw_normal(key: Array, shape: tuple[int, ...], std: float, dtype: Any) -> Array:
    """`jax.random.normal(key, shape, dtype) * std`, with `std` rounded to `dtype` first (as
    flax's normal initializer does); the same bits eagerly and under a trace."""
    shape, std, dtype = tuple(shape), float(std), jnp.dtype(dtype)
    if isinstance(key, jax.core.Tracer):
        return _draw(key, shape=shape, std=std, dtype=dtype)
    size = math.prod(shape)
    if not 0 < size <= SHARED_DRAW_MAX or not _prefix_stable(key):
        return _compiled_draw(key, shape=shape, std=std, dtype=dtype)
    drawn = _compiled_draw(key, shape=(size_class(size),), std=std, dtype=dtype)
    (device,) = drawn.devices()
    cut = np.asarray(drawn)[:size].reshape(shape)
    # A copy in memory XLA owns (one copy program per shape, ~7 ms to compile against a draw's
    # ~100): an array on numpy's memory could not be donated to the first train step, and it
    # would keep the whole draw alive.
    with jax.default_device(device):
        return jnp.array(cut, copy=True)


def normal_param_values(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype: Any) -> Array:
    """A new parameter's values: N(0, std^2) from the model's `params` stream."""
    return draw_normal(rngs.params(), shape, std, dtype)
