"""Matmuls in float8 (`TrainingArguments.fp8_matmuls`): the decoder layers' projections with
both operands in float8, for the FP8 tensor cores of Hopper-class GPUs (H100, H200).

Forward: activations and kernels in e4m3 (more mantissa), each scaled by its own current
absolute maximum (per-tensor "current scaling": no state to carry between steps), multiplied
with a float32 accumulator and scaled back. Backward: the incoming gradient in e5m2 (more
range), so both gradient matmuls are float8 too; the saved activations are the float8 copies
(half the bytes of bf16 ones). On Hopper, XLA:GPU can run a dot of float8 operands on the
FP8 tensor cores (bench/accelerator.py's `fp8` variant measures whether it pays); on a CPU it
only costs, and the tests run it there for its numbers. The embedding, the norms and the LM head stay in the compute dtype, as
Transformer Engine keeps them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

__all__ = ["FORWARD_DTYPE", "GRADIENT_DTYPE", "fp8_matmul", "quantize"]

FORWARD_DTYPE = jnp.float8_e4m3fn
GRADIENT_DTYPE = jnp.float8_e5m2


def quantize(x: Array, dtype: jnp.dtype) -> tuple[Array, Array]:
    """x as `dtype`, scaled so its absolute maximum lands on the format's largest finite
    value, and the scale that undoes it (float32; 1 for an all-zero x)."""
    largest = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / largest, 1.0)
    scaled = jnp.clip(x.astype(jnp.float32) / scale, -largest, largest)
    return scaled.astype(dtype), scale


def _dot(a: Array, b: Array, scale: Array, dtype: jnp.dtype) -> Array:
    """[M, K] x [K, N] of float8 operands, accumulated in float32, times `scale`."""
    out = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (out * scale).astype(dtype)


@jax.custom_vjp
def fp8_matmul(x: Array, kernel: Array) -> Array:
    """x [M, K] @ kernel [K, N] with both operands in float8 (module docstring); the result
    and the gradients in the inputs' dtypes."""
    return _forward(x, kernel)[0]


def _forward(x: Array, kernel: Array) -> tuple[Array, tuple]:
    xq, x_scale = quantize(x, FORWARD_DTYPE)
    kq, k_scale = quantize(kernel, FORWARD_DTYPE)
    y = _dot(xq, kq, x_scale * k_scale, x.dtype)
    zeros = (jnp.zeros((), x.dtype), jnp.zeros((), kernel.dtype))  # the inputs' dtypes
    return y, (xq, x_scale, kq, k_scale, zeros)


def _backward(saved: tuple, grad: Array) -> tuple[Array, Array]:
    xq, x_scale, kq, k_scale, (x_like, kernel_like) = saved
    gq, g_scale = quantize(grad, GRADIENT_DTYPE)
    dx = _dot(gq, kq.T, g_scale * k_scale, x_like.dtype)
    dkernel = _dot(xq.T, gq, x_scale * g_scale, kernel_like.dtype)
    return dx, dkernel


fp8_matmul.defvjp(_forward, _backward)
