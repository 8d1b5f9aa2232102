"""Blockwise quantization of a [rows, cols] matrix along its rows: NF4 and int8.

Each column is cut into blocks of `block` consecutive rows; a block's values are divided by
its absolute maximum (its scale) and stored as codes:

- NF4 (Dettmers et al., QLoRA, 2023, Appendix E): 4-bit codes indexing NF4_TABLE, the 16
  quantiles of a standard normal scaled to [-1, 1] with an exact 0; the nearest level is
  chosen. Two codes share a byte (the even row in the high nibble).
- int8: the code is round(127 * x / absmax), a symmetric linear level.

Double quantization (QLoRA's "quantize the quantization constants") stores the float32 block
scales themselves as int8 codes with one float32 scale per group of DOUBLE_GROUP scales along
the rows: 8.5 bits per 64 weights become about 0.5 + 1/64.

Pure jax.numpy: quantize and dequantize run inside jit (the dequantization in every step).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "DOUBLE_GROUP",
    "KINDS",
    "NF4_TABLE",
    "QuantizedMatrix",
    "dequantize",
    "quantize",
]

Array = jax.Array

# The NF4 levels as the QLoRA paper lists them (Appendix E) and bitsandbytes stores them.
NF4_TABLE = np.asarray(
    [
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
    ],
    np.float32,
)  # fmt: skip
KINDS = ("nf4", "int8")
DOUBLE_GROUP = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedMatrix:
    """A [rows, cols] matrix as codes and block scales (see the module docstring)."""

    codes: Array  # nf4: [rows / 2, cols] uint8 (two codes a byte); int8: [rows, cols] int8
    scales: Array  # [rows / block, cols]: float32, or int8 codes with double quantization
    scales_scale: Array | None  # [ceil(rows / block / DOUBLE_GROUP), cols] float32, or None
    kind: str = dataclasses.field(metadata=dict(static=True))
    block: int = dataclasses.field(metadata=dict(static=True))


def _absmax_blocks(x: Array, block: int) -> tuple[Array, Array]:
    """(x as [rows / block, block, cols], each block's absolute maximum [rows / block, cols])."""
    rows, cols = x.shape
    blocks = x.reshape(rows // block, block, cols)
    return blocks, jnp.max(jnp.abs(blocks), axis=1)


def _double(scales: Array) -> tuple[Array, Array]:
    """float32 scales [n, cols] as int8 codes and one float32 scale per DOUBLE_GROUP rows."""
    n, cols = scales.shape
    groups = -(-n // DOUBLE_GROUP)
    padded = jnp.pad(scales, ((0, groups * DOUBLE_GROUP - n), (0, 0)))
    grouped = padded.reshape(groups, DOUBLE_GROUP, cols)
    top = jnp.max(jnp.abs(grouped), axis=1)
    safe = jnp.where(top > 0, top, 1.0)
    codes = jnp.round(grouped / safe[:, None] * 127).astype(jnp.int8)
    return codes.reshape(groups * DOUBLE_GROUP, cols)[:n], top


def _undouble(codes: Array, top: Array) -> Array:
    n = codes.shape[0]
    return codes.astype(jnp.float32) / 127 * jnp.repeat(top, DOUBLE_GROUP, axis=0)[:n]


def quantize(x: Array, kind: str, block: int, *, double: bool = False) -> QuantizedMatrix:
    """`x` [rows, cols] quantized along its rows in blocks of `block` (rows % block == 0)."""
    x = x.astype(jnp.float32)
    blocks, absmax = _absmax_blocks(x, block)
    safe = jnp.where(absmax > 0, absmax, 1.0)[:, None, :]
    normalised = (blocks / safe).reshape(x.shape)
    if kind == "nf4":
        table = jnp.asarray(NF4_TABLE)
        index = jnp.argmin(jnp.abs(normalised[..., None] - table), axis=-1).astype(jnp.uint8)
        codes = (index[0::2] << 4) | index[1::2]  # the even row in the high nibble
    elif kind == "int8":
        codes = jnp.round(normalised * 127).astype(jnp.int8)
    else:
        raise ValueError(f"quantization kind {kind!r}: use one of {KINDS}")
    scales, top = _double(absmax) if double else (absmax, None)
    return QuantizedMatrix(codes, scales, top, kind, block)


def dequantize(q: QuantizedMatrix, dtype: jnp.dtype = jnp.float32) -> Array:
    """The [rows, cols] matrix `q` stands for, in `dtype`."""
    scales = q.scales if q.scales_scale is None else _undouble(q.scales, q.scales_scale)
    if q.kind == "nf4":
        high, low = q.codes >> 4, q.codes & 0xF
        index = jnp.stack([high, low], axis=1).reshape(-1, q.codes.shape[1])
        values = jnp.asarray(NF4_TABLE)[index]
    else:
        values = q.codes.astype(jnp.float32) / 127
    rows, cols = values.shape
    blocks = values.reshape(rows // q.block, q.block, cols) * scales[:, None, :]
    return blocks.reshape(rows, cols).astype(dtype)
