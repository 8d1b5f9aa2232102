"""A decoder layer's elementwise work: RMSNorm (with the residual add before it), SwiGLU's gate
and rotary position embeddings, by XLA or by fused Pallas kernels on NVIDIA GPUs.

In the one GPU profile of a 1.1B step (H100), elementwise fusions took 22% of device time
(issue 49). Each function here takes `kernel`:

- "xla" (the default): plain jnp, fused by XLA as it sees fit. This is the reference, and what
  every family computes.
- "pallas": one Pallas kernel (Triton) per op that reads its inputs once and writes its outputs
  once. `add_rms_norm` returns the residual sum and its norm from one pass, where XLA:GPU
  writes the sum and reads it back in the norm's reduction fusion. NVIDIA GPUs only.
- "interpret": those kernels' own code in Pallas' interpret mode, on any backend (the tests,
  on CPU; slow).

The kernels are the forward pass of a `custom_vjp` whose backward pass is the reference's
own gradient, from the saved inputs, so a run's gradients do not depend on the choice. A
kernel works on rows of the last dimension in power-of-two column blocks with masked edges, so
any width runs (Triton's tensors are powers of two). A run chooses with
`TrainingArguments.elementwise_kernels`; the default stays "xla" until the campaign
(`bench/accelerator.py`, variant "fused") measures the kernels on a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.config.tables import ELEMENTWISE_KERNELS as KERNELS
from jaxtrain.errors import ArgumentError
from jaxtrain.models.blocks import gated

Array = jax.Array
_LARGEST_BLOCK = 4096  # columns per load: 16 KiB of float32 in registers at most


# ------------------------------------------------------------------------ the reference
def rms_norm(x: Array, weight: Array, eps: float, dtype: Any) -> Array:
    """RMSNorm over the last axis: normalised in float32 (stable for bf16 inputs), cast to the
    compute `dtype`, then scaled in it, in Hugging Face's order."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return weight.astype(dtype) * (x32 * jax.lax.rsqrt(var + eps)).astype(dtype)


def silu_gate(gate: Array, up: Array) -> Array:
    """SwiGLU's ``silu(gate) * up``, keeping only gate and up for the backward pass."""
    return gated(jax.nn.silu, gate, up)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate x [B, T, ..., H] by cos/sin [B, T, H] (any number of head dims between)."""
    extra = x.ndim - cos.ndim
    shape = cos.shape[:2] + (1,) * extra + cos.shape[2:]
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos + rotated * sin


def _add_rms_norm_reference(x, delta, weight, eps, dtype):
    total = x + delta
    return total, rms_norm(total, weight, eps, dtype)


# ------------------------------------------------------------------------ the choices
def check_kernel(kernel: str, name: str = "elementwise kernel") -> None:
    """A clear error (`name`: what the user set) for a kernel that cannot run here."""
    if kernel not in KERNELS:
        raise ArgumentError(f"{name}={kernel!r}: choose one of {', '.join(KERNELS)}.")
    if kernel == "pallas" and jax.default_backend() != "gpu":
        raise ArgumentError(f"{name}='pallas' runs Triton kernels on NVIDIA GPUs, and this run "
                            f"is on {jax.default_backend()}: use 'xla' (the default).")  # fmt: skip


def add_rms_norm(
    x: Array, delta: Array, weight: Array, *, eps: float, dtype: Any, kernel: str = "xla"
) -> tuple[Array, Array]:
    """(x + delta, rms_norm(x + delta)): a layer's residual add and the next norm."""
    if kernel == "xla":
        return _add_rms_norm_reference(x, delta, weight, eps, dtype)
    check_kernel(kernel)
    return _fused(_add_rms_norm_reference, _add_rms_norm_rows, kernel, eps=eps, dtype=dtype)(
        x, delta, weight
    )


def swiglu(gate: Array, up: Array, *, kernel: str = "xla") -> Array:
    """``silu(gate) * up`` (the MLP's gate, before its down projection)."""
    if kernel == "xla":
        return silu_gate(gate, up)
    check_kernel(kernel)
    return _fused(silu_gate, _swiglu_rows, kernel)(gate, up)


def rotary(x: Array, cos: Array, sin: Array, *, kernel: str = "xla") -> Array:
    """`apply_rope`: x [B, T, heads, H] rotated by cos/sin [B, T, H]."""
    if kernel == "xla" or x.ndim != 4:
        return apply_rope(x, cos, sin)
    check_kernel(kernel)
    return _fused(apply_rope, _rotary_rows, kernel)(x, cos, sin)


def _fused(reference: Callable, rows: Callable, kernel: str, **static: Any) -> Callable:
    """`rows` (the kernels' forward) with the reference's gradient, from the saved inputs."""
    forward = functools.partial(rows, interpret=kernel == "interpret", **static)
    backward_of = functools.partial(reference, **static)

    @jax.custom_vjp
    def op(*inputs):
        return forward(*inputs)

    def op_forward(*inputs):
        return forward(*inputs), inputs

    def op_backward(inputs, grads):
        return jax.vjp(backward_of, *inputs)[1](grads)

    op.defvjp(op_forward, op_backward)
    return op


# ------------------------------------------------------------------------ the kernels
def _pallas_rows(kernel, out_shapes, interpret: bool, batch_axes: tuple) -> Callable:
    """A kernel on one row, as a pallas_call vmapped over the leading dims (vmap turns them
    into the kernel's grid, one program per row)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    width = out_shapes[0].shape[-1]
    warps = min(max(_block(width) // 256, 1), 8)
    call = pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        grid=(),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=warps),
    )
    return jax.vmap(call, in_axes=batch_axes)


def _block(width: int) -> int:
    block = 16
    while block < width and block < _LARGEST_BLOCK:
        block *= 2
    return block


def _load(ref, index, mask):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(ref.at[index], mask=mask, other=0)


def _store(ref, index, value, mask):
    from jax.experimental.pallas import triton as plgpu

    plgpu.store(ref.at[index], value.astype(ref.dtype), mask=mask)


def _for_blocks(width: int, body: Callable, carry=None):
    """body(columns, mask, carry) over `width` columns in power-of-two blocks."""
    from jax.experimental import pallas as pl

    block = _block(width)

    def step(i, carry):
        columns = i * block + jnp.arange(block)
        return body(columns, columns < width, carry)

    return jax.lax.fori_loop(0, pl.cdiv(width, block), step, carry)


def _add_rms_norm_rows(x, delta, weight, *, eps, dtype, interpret):
    width = x.shape[-1]

    def kernel(x_ref, delta_ref, weight_ref, total_ref, out_ref):
        def squares(columns, mask, acc):
            total = _load(x_ref, columns, mask) + _load(delta_ref, columns, mask)
            _store(total_ref, columns, total, mask)
            t32 = total.astype(jnp.float32)
            return acc + jnp.where(mask, t32 * t32, 0.0)

        acc = _for_blocks(width, squares, jnp.zeros(_block(width), jnp.float32))
        inverse = jax.lax.rsqrt(acc.sum() / width + eps)

        def normalise(columns, mask, carry):
            # x + delta again rather than a read of total_ref: no barrier between the
            # threads that wrote it and those that would read it.
            total = _load(x_ref, columns, mask) + _load(delta_ref, columns, mask)
            scaled = (total.astype(jnp.float32) * inverse).astype(dtype)
            _store(out_ref, columns, _load(weight_ref, columns, mask).astype(dtype) * scaled, mask)
            return carry

        _for_blocks(width, normalise, 0)

    lead = x.shape[:-1]
    flat = lambda a: a.reshape(-1, width)  # noqa: E731
    total_dtype = jnp.result_type(x, delta)  # as the reference's x + delta
    shapes = (jax.ShapeDtypeStruct((width,), total_dtype), jax.ShapeDtypeStruct((width,), dtype))
    run = _pallas_rows(kernel, shapes, interpret, (0, 0, None))
    total, out = run(flat(x), flat(delta), weight)
    return total.reshape(*lead, width), out.reshape(*lead, width)


def _swiglu_rows(gate, up, *, interpret):
    width = gate.shape[-1]

    def kernel(gate_ref, up_ref, out_ref):
        def body(columns, mask, carry):
            # silu in float32: Triton divides only float32 and float64 (sigmoid's 1 / ...).
            g = _load(gate_ref, columns, mask).astype(jnp.float32)
            up = _load(up_ref, columns, mask).astype(jnp.float32)
            _store(out_ref, columns, jax.nn.silu(g) * up, mask)
            return carry

        _for_blocks(width, body, 0)

    out_dtype = jnp.result_type(gate, up)
    run = _pallas_rows(kernel, (jax.ShapeDtypeStruct((width,), out_dtype),), interpret, (0, 0))
    (out,) = run(gate.reshape(-1, width), up.reshape(-1, width))
    return out.reshape(gate.shape)


def _rotary_rows(x, cos, sin, *, interpret):
    b, t, heads, width = x.shape
    half = width // 2

    def kernel(x_ref, cos_ref, sin_ref, out_ref):
        def body(columns, mask, carry):
            first, second = _load(x_ref, columns, mask), _load(x_ref, columns + half, mask)
            # The reference's order: x * cos + rotate_half(x) * sin, per half.
            c1, c2 = _load(cos_ref, columns, mask), _load(cos_ref, columns + half, mask)
            s1, s2 = _load(sin_ref, columns, mask), _load(sin_ref, columns + half, mask)
            _store(out_ref, columns, first * c1 + (-second) * s1, mask)
            _store(out_ref, columns + half, second * c2 + first * s2, mask)
            return carry

        _for_blocks(half, body, 0)

    out_dtype = jnp.result_type(x, cos, sin)
    cos, sin = (jnp.broadcast_to(a, (b, t, width)) for a in (cos, sin))  # [1, T, H]: shared
    row = (jax.ShapeDtypeStruct((width,), out_dtype),)
    # Rows are (b, t) positions, each with `heads` rows of x and one of cos and sin.
    per_head = _pallas_rows(kernel, row, interpret, (0, None, None))
    run = jax.vmap(per_head, in_axes=(0, 0, 0))
    (out,) = run(x.reshape(b * t, heads, width), cos.reshape(b * t, width),
                 sin.reshape(b * t, width))  # fmt: skip
    return out.reshape(x.shape)
