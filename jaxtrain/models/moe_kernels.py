"""Pallas kernels for the grouped expert matmuls of mixture-of-experts layers.

- GPU: our own Triton-style Pallas kernels on the *blocked* layout of ``moe_dispatch`` (rows
  sorted by expert and padded per expert to whole blocks, so a block of rows belongs to one
  expert). Three kernels, as megablox has on TPU: the forward (``x_j @ w[e_j]``), the input
  gradient (the same kernel reading ``w[e]`` transposed) and the weight gradient (per expert,
  a loop over that expert's blocks only). Blocks past ``used`` cost nothing. Dimensions of any
  size: tiles are powers of two of at least 16 (Triton's dot needs them), edges are masked.
  ``interpret=True`` runs the kernels' own code on any platform (the tests, on CPU). JAX
  0.11 deprecates Pallas' Triton backend for Mosaic GPU, whose Hopper-only ragged dot has no
  interpret mode a CPU test can use; the campaign's gmm stage measures the two side by side.
- TPU: JAX's megablox ``gmm`` (its custom VJP holds ``tgmm`` for the weight gradient) on the
  *ragged* layout that ``jax.lax.ragged_dot`` takes: no reason to write what JAX ships tuned
  for the TPU's MXU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

Array = jax.Array

# The smallest tile Triton's dot takes, and the largest tiles used (shared memory per stage
# stays below 64 KiB in bf16 with 128-row blocks).
_MIN_TILE = 16
_COLUMN_TILE = 128
_DEPTH_TILE = 64


def tile(size: int, most: int) -> int:
    """The smallest power of two >= min(size, most), at least 16."""
    t = _MIN_TILE
    while t < most and t < size:
        t *= 2
    return t


def _params(tile_elements: int):
    """Triton's launch settings: 8 warps for a 128 x 128 output tile (Triton's usual matmul
    setting; 4 would hold 128 float32 accumulators a thread), 4 below."""
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=8 if tile_elements >= 128 * 128 else 4, num_stages=2)


def _block_kernel(expert_ref, used_ref, x_ref, w_ref, out_ref, *, transpose, cols, depth):
    """out[i, :, j-th tile] = x[i] @ w[e_i] (or @ w[e_i].T) for block i < used, else 0."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    i, j = pl.program_id(0), pl.program_id(1)
    expert = expert_ref[i]
    size_k, width = x_ref.shape[2], out_ref.shape[2]
    col_ok = j * cols + jnp.arange(cols) < width

    def step(c, acc):
        k_ok = c * depth + jnp.arange(depth) < size_k
        x = plt.load(x_ref.at[i, :, pl.ds(c * depth, depth)], mask=k_ok[None, :], other=0.0)
        if transpose:  # w [E, width, K]: contract both operands' last axes
            w = plt.load(w_ref.at[expert, pl.ds(j * cols, cols), pl.ds(c * depth, depth)],
                         mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            dims = (((1,), (1,)), ((), ()))
        else:  # w [E, K, width]
            w = plt.load(w_ref.at[expert, pl.ds(c * depth, depth), pl.ds(j * cols, cols)],
                         mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
            dims = (((1,), (0,)), ((), ()))
        return acc + jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)

    # A product, not jnp.where: Pallas' Triton lowering gives a where's weakly typed constant
    # branches the predicate's type (i1), and Triton then rejects the loop's i1 bound.
    steps = pl.cdiv(size_k, depth) * (i < used_ref[0]).astype(jnp.int32)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((x_ref.shape[1], cols), jnp.float32))
    plt.store(out_ref.at[i, :, pl.ds(j * cols, cols)], acc.astype(out_ref.dtype),
              mask=col_ok[None, :])  # fmt: skip


def block_products(
    x: Array, w: Array, block_expert: Array, used: Array, *, transpose: bool, interpret: bool
) -> Array:
    """[NB, B, width]: x [NB, B, K] times w [E, K, width] (or w [E, width, K] transposed)
    of each block's expert; blocks from ``used`` on are zeros."""
    from jax.experimental import pallas as pl

    blocks, rows, size_k = x.shape
    width = w.shape[1] if transpose else w.shape[2]
    cols, depth = tile(width, _COLUMN_TILE), tile(size_k, _DEPTH_TILE)
    kernel = functools.partial(_block_kernel, transpose=transpose, cols=cols, depth=depth)
    return pl.pallas_call(
        kernel,
        grid=(blocks, pl.cdiv(width, cols)),
        out_shape=jax.ShapeDtypeStruct((blocks, rows, width), x.dtype),
        compiler_params=_params(rows * cols),
        interpret=interpret,
    )(block_expert, jnp.reshape(used, (1,)).astype(jnp.int32), x, w)


def _weight_grad_kernel(first_ref, count_ref, x_ref, dy_ref, dw_ref, *, depth, cols):
    """dw[e, tile a, tile b] = sum over expert e's blocks j of x[j, :, a].T @ dy[j, :, b]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    e, a, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k_ok = a * depth + jnp.arange(depth) < x_ref.shape[2]
    m_ok = b * cols + jnp.arange(cols) < dy_ref.shape[2]

    def step(j, acc):
        x = plt.load(x_ref.at[j, :, pl.ds(a * depth, depth)], mask=k_ok[None, :], other=0.0)
        dy = plt.load(dy_ref.at[j, :, pl.ds(b * cols, cols)], mask=m_ok[None, :], other=0.0)
        dims = (((0,), (0,)), ((), ()))
        return acc + jax.lax.dot_general(x, dy, dims, preferred_element_type=jnp.float32)

    first = first_ref[e]
    acc = jax.lax.fori_loop(
        first, first + count_ref[e], step, jnp.zeros((depth, cols), jnp.float32)
    )
    plt.store(dw_ref.at[e, pl.ds(a * depth, depth), pl.ds(b * cols, cols)],
              acc.astype(dw_ref.dtype), mask=k_ok[:, None] & m_ok[None, :])  # fmt: skip


def weight_grad(
    x: Array, dy: Array, block_expert: Array, used: Array, experts: int, *, interpret: bool
) -> Array:
    """[E, K, M]: each expert's sum of x_j.T @ dy_j over its blocks j < used (contiguous,
    as the blocked layout sorts them)."""
    from jax.experimental import pallas as pl

    blocks, _, size_k = x.shape
    width = dy.shape[2]
    live = (jnp.arange(blocks) < used).astype(jnp.int32)
    count = jnp.zeros((experts,), jnp.int32).at[block_expert].add(live)
    first = jnp.cumsum(count) - count
    depth, cols = tile(size_k, _DEPTH_TILE), tile(width, _DEPTH_TILE)
    kernel = functools.partial(_weight_grad_kernel, depth=depth, cols=cols)
    return pl.pallas_call(
        kernel,
        grid=(experts, pl.cdiv(size_k, depth), pl.cdiv(width, cols)),
        out_shape=jax.ShapeDtypeStruct((experts, size_k, width), x.dtype),
        compiler_params=_params(depth * cols),
        interpret=interpret,
    )(first.astype(jnp.int32), count, x, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def gpu_grouped_matmul(
    x: Array, w: Array, block_expert: Array, used: Array, interpret: bool = False
) -> Array:
    """``moe_dispatch.grouped_matmul`` as GPU kernels: x [NB, B, K], w [E, K, M] ->
    [NB, B, M], block j times the matrix of expert ``block_expert[j]``, zeros from
    ``used`` on. B must be a power of two >= 16."""
    return block_products(x, w, block_expert, used, transpose=False, interpret=interpret)


def _gpu_fwd(x, w, block_expert, used, interpret):
    y = block_products(x, w, block_expert, used, transpose=False, interpret=interpret)
    return y, (x, w, block_expert, used)


def _gpu_bwd(interpret, residuals, dy):
    x, w, block_expert, used = residuals
    dx = block_products(dy, w, block_expert, used, transpose=True, interpret=interpret)
    dw = weight_grad(x, dy, block_expert, used, w.shape[0], interpret=interpret)
    return dx, dw.astype(w.dtype), None, None


gpu_grouped_matmul.defvjp(_gpu_fwd, _gpu_bwd)


def tpu_ragged_matmul(rows: Array, w: Array, group_sizes: Array, *, interpret: bool) -> Array:
    """``jax.lax.ragged_dot(rows, w, group_sizes)`` by megablox: rows [R, K] (group g's rows
    after group g-1's), w [G, K, M]. Rows past the groups come back as zeros."""
    from jax.experimental.pallas.ops.tpu.megablox import ops

    count, size_k = rows.shape
    # megablox leaves rows no group covers unwritten, in its output and its input gradient:
    # both are zeroed here.
    covered = jnp.arange(count) < jnp.sum(group_sizes)
    rows = jnp.where(covered[:, None], rows, 0)
    tm = 128 if count >= 128 else -(-count // 8) * 8  # megablox needs whole row tiles
    padded = -(-count // tm) * tm
    lhs = jnp.pad(rows, ((0, padded - count), (0, 0)))
    tiling = (tm, min(128, size_k), min(128, w.shape[2]))
    out = ops.gmm(lhs, w, group_sizes.astype(jnp.int32), rows.dtype, tiling, None, None, False,
                  interpret)[:count]  # fmt: skip
    return jnp.where(covered[:, None], out, 0)
