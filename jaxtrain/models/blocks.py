"""Pieces of the GPT-2 / ViT style transformer: LayerNorm with bias, GELU activations; and
the gated activation every gated MLP (Llama's SwiGLU, Gemma's GeGLU, the MoE experts) uses.

Kept apart from layers.py (the Llama family's RMSNorm/SwiGLU/RoPE blocks) so each family's
changes stay separate.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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
    return _recomputed_gelu(x, GELU_ACTS[act])


# Differentiated as written, an activation keeps its intermediates (gelu's tanh and powers,
# silu's sigmoid and product) alive from the forward to the backward pass, each as large as
# the MLP's [B, T, F] hidden layer. Under jax.checkpoint only its inputs are kept and the
# backward recomputes the rest in the same elementwise pass that uses it: on the 37.8M
# Llama of bench/overhead.py -134 MB of the train step's 1.7 GB of temporaries, no slower.
@functools.partial(jax.checkpoint, static_argnums=(1,))
def _recomputed_gelu(x: Array, approximate: bool) -> Array:
    return jax.nn.gelu(x, approximate=approximate)


@functools.partial(jax.checkpoint, static_argnums=(0,))
def gated(activation: Callable[[Array], Array], gate: Array, up: Array) -> Array:
    """``activation(gate) * up`` keeping only ``gate`` and ``up`` for the backward pass."""
    return activation(gate) * up


def gelu_tanh(x: Array) -> Array:
    """GELU with the tanh approximation (one function, so ``gated`` traces it once)."""
    return jax.nn.gelu(x, approximate=True)


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
