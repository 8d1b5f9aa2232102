"""Pieces of the GPT-2 / ViT style transformer: LayerNorm with bias, GELU activations.

Kept apart from layers.py (the Llama family's RMSNorm/SwiGLU/RoPE blocks) so each family's
changes stay separate.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Array = jax.Array
DType = Any

# HF activation name -> whether jax.nn.gelu uses the tanh approximation.
GELU_ACTS = {"gelu": False, "gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True}


def gelu(x: Array, act: str) -> Array:
    if act not in GELU_ACTS:
        raise ValueError(f"activation {act!r} is not supported; use one of {sorted(GELU_ACTS)}.")
    return jax.nn.gelu(x, approximate=GELU_ACTS[act])


class LayerNorm(nnx.Module):
    """LayerNorm (scale and bias) computed in float32, output in the compute dtype."""

    def __init__(self, dim: int, *, eps: float, dtype: DType, param_dtype: DType):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), logical_axes=("embed",))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=("embed",))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(axis=-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)
