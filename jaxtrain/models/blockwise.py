"""Blockwise causal attention: FlashAttention-2's online softmax in plain JAX.

Queries are cut into blocks of ``block_q`` tokens and keys/values into blocks of
``block_k``; each query block folds in one key block at a time, keeping a running row
maximum, row sum and output accumulator, so no [T, T] array ever exists. The backward pass
(``jax.custom_vjp``) saves only q, k, v, the output and the row log-sum-exp and recomputes
each block's scores.

Every mask jaxtrain has is built per block from small vectors: causal order, the sliding
window (HF Mistral: query i sees key j when 0 <= i - j < window), packed segments
(``segment_ids`` [B, T]; padding is segment 0, see masking.py) and keys past the true
length. A key block that the mask hides from every row of a query block is never computed:
the inner loop runs only over the span of needed key blocks and ``lax.cond`` skips the
blocks inside it that belong to other documents (per-block min/max segment ids). Padding
makes no block needed: a block that is padding in every row of the batch is skipped (its
queries' outputs are zeros, which nothing reads), so short rows padded to a long length
cost the attention of the batch's longest row.

The per-pair functions (``chunk_forward``, ``chunk_backward``) take the global token index
of the first query and first key, so ring attention (ring.py) reuses them for key/value
chunks that live on other devices.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain.models.sharding import step_platform

Array = jax.Array

# A finite "minus infinity": exp(NEG - m) underflows to 0 without inf - inf = nan.
NEG = -1e30

# Default block sizes (query, key). CPU (2 cores, forward + backward of one layer's attention,
# `bench/attention_blocks.py`, bench/RESULTS.md session 42): 256 x 256 took 0.67-0.74x the
# time of 128 x 128 with 4 query heads of 64 over 2 key heads at 1k-8k tokens and 0.69x on a
# packed 32k-token row; with 8 heads of 32, 0.92-0.97x at 4k-8k and 1.08x at 1k (within the
# spread). Fewer blocks are skipped, but each loop iteration's fixed cost weighs less. GPU:
# not measured; larger blocks there amortise the kernel launches of each loop iteration.
CPU_BLOCKS = (256, 256)
# Ring attention's chunks on simulated CPU devices (sp = 8 threads sharing 2 cores): the
# long-context page's 32k-token packed row trained its step in 61.6 s with 128 x 128 and 78.7 s
# with 256 x 256 (one process each, the same hour).
CPU_RING_BLOCKS = (128, 128)
GPU_BLOCKS = (512, 512)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static part of a blockwise attention call (hashable: a custom_vjp argument)."""

    block_q: int
    block_k: int
    scale: float
    logit_cap: float | None = None
    window: int | None = None


def default_blocks(ring: bool = False) -> tuple[int, int]:
    """(block_q, block_k) when the caller sets none, for the devices the step is traced for
    (a GPU plan compiled on a CPU host takes the GPU's): the GPU's, else the CPU's (TPUs
    too: not measured there); `ring`: ring attention's per-chunk blocks."""
    if step_platform()[0] == "gpu":
        return GPU_BLOCKS
    return CPU_RING_BLOCKS if ring else CPU_BLOCKS


def make_spec(
    q: Array,
    *,
    kv_length: int,
    sliding_window: int | None,
    scale: float | None,
    logit_cap: float | None,
    block_q: int | None,
    block_k: int | None,
) -> AttentionSpec:
    default_q, default_k = default_blocks()
    return AttentionSpec(
        block_q=min(block_q or default_q, q.shape[1]),
        block_k=min(block_k or default_k, kv_length),
        scale=float(q.shape[3] ** -0.5 if scale is None else scale),
        logit_cap=None if logit_cap is None else float(logit_cap),
        window=sliding_window,
    )


def blockwise_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    segment_ids: Array | None = None,
    sliding_window: int | None = None,
    scale: float | None = None,
    logit_cap: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> Array:
    """Causal grouped-query attention, q [B,T,N,H], k/v [B,T,K,H] (N % K == 0) -> [B,T,N,H].

    The same numbers as ``attention.grouped_attention`` with ``attention.causal_mask``
    (scores and softmax in float32, ``scale`` default 1/sqrt(H), ``logit_cap`` Gemma 2's
    soft-capping) in O(T * block) memory.
    """
    spec = make_spec(
        q,
        kv_length=k.shape[1],
        sliding_window=sliding_window,
        scale=scale,
        logit_cap=logit_cap,
        block_q=block_q,
        block_k=block_k,
    )
    if segment_ids is None:  # one document: the overlap test then never skips anything
        segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    segment_ids = segment_ids.astype(jnp.int32)
    return _attention(q, k, v, segment_ids, spec)


# ------------------------------------------------------------------ layout helpers
def blocked_tokens(x: Array, block: int, mode: str = "edge") -> Array:
    """x [B, T, ...] -> [n_blocks, B, block, ...], padded at the end. "edge" repeats the
    last token (padded keys are masked by index; repeating keeps per-block segment ranges);
    outputs and their cotangents pad with zeros so padded rows add nothing to gradients."""
    t = x.shape[1]
    n = -(-t // block)
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n * block - t)
    x = jnp.pad(x, pad, mode=mode) if n * block > t else x
    return jnp.moveaxis(x.reshape(x.shape[0], n, block, *x.shape[2:]), 1, 0)


def unblocked(x: Array, length: int) -> Array:
    """[n_blocks, B, K, G, block, H] -> [B, length, K * G, H]."""
    nb, b, kh, g, blk, h = x.shape
    x = jnp.transpose(x, (1, 0, 4, 2, 3, 5)).reshape(b, nb * blk, kh * g, h)
    return x[:, :length]


def to_block_layout(x: Array, kv_heads: int, block: int) -> Array:
    """[B, T, N, H] -> [nq, B, K, G, bq, H], the layout of outputs and their cotangents."""
    x = blocked_tokens(x, block, mode="constant")  # [nq, B, bq, N, H]
    nq, b, blk, n, h = x.shape
    x = x.reshape(nq, b, blk, kv_heads, n // kv_heads, h)
    return jnp.transpose(x, (0, 1, 3, 4, 2, 5))


# ------------------------------------------------------------------ which blocks are needed
def needed_blocks(
    q_start: Array,
    k_start: Array,
    q_seg: Array,
    k_seg: Array,
    k_length: int,
    spec: AttentionSpec,
) -> tuple[Array, Array, Array]:
    """(need [nq, nk] bool, first [nq], last [nq]): whether some query of block i may see
    some key of block j, and the span of needed key blocks per query block.

    q_seg [nq, B, bq], k_seg [nk, B, bk] (blocked); q_start/k_start: global index of the
    first query / key of these chunks.
    """
    nq, nk = q_seg.shape[0], k_seg.shape[0]
    q_first = q_start + jnp.arange(nq) * spec.block_q
    q_last = q_first + spec.block_q - 1
    k_first = k_start + jnp.arange(nk) * spec.block_k
    k_last = k_start + jnp.minimum((jnp.arange(nk) + 1) * spec.block_k, k_length) - 1
    need = k_first[None, :] <= q_last[:, None]  # causal: not wholly in the future
    if spec.window is not None:  # not wholly before every query's window
        need &= q_first[:, None] - k_last[None, :] < spec.window
    # Segments: some row has a query segment and a key segment whose ranges overlap.
    qs_min, qs_max = real_segment_range(q_seg)  # [nq, B]
    ks_min, ks_max = real_segment_range(k_seg)  # [nk, B]
    overlap = (ks_min[None] <= qs_max[:, None]) & (ks_max[None] >= qs_min[:, None])
    need &= overlap.any(axis=2)
    first = jnp.argmax(need, axis=1)
    last = nk - 1 - jnp.argmax(need[:, ::-1], axis=1)
    any_needed = need.any(axis=1)
    return need, jnp.where(any_needed, first, 0), jnp.where(any_needed, last, -1)


def real_segment_range(seg: Array) -> tuple[Array, Array]:
    """(min, max) [n, B] of each block's segment ids, padding (0) left out: a block of
    padding alone gets an empty range (min > max), which overlaps nothing."""
    real = seg > 0
    low = jnp.where(real, seg, jnp.iinfo(jnp.int32).max).min(axis=2)
    return low, jnp.where(real, seg, -1).max(axis=2)


def block_mask(
    q_index: Array, k_index: Array, q_seg: Array, k_seg: Array, k_end: Array, spec: AttentionSpec
) -> Array:
    """[B, 1, 1, bq, bk] bool: key visible to query (causal, window, segment, real key)."""
    offset = q_index[:, None] - k_index[None, :]  # [bq, bk]
    visible = (offset >= 0) & (k_index < k_end)[None, :]
    if spec.window is not None:
        visible &= offset < spec.window
    visible = visible[None] & (q_seg[:, :, None] == k_seg[:, None, :])
    return visible[:, None, None]


def block_scores(qb: Array, kb: Array, spec: AttentionSpec) -> tuple[Array, Array | None]:
    """Scaled (and soft-capped) float32 scores [B, K, G, bq, bk] and tanh for the backward."""
    s = jnp.einsum("bqkgh,bskh->bkgqs", qb, kb, preferred_element_type=jnp.float32)
    s = s * spec.scale
    if spec.logit_cap is None:
        return s, None
    t = jnp.tanh(s / spec.logit_cap)
    return spec.logit_cap * t, t


# ------------------------------------------------------------------ one (q chunk, kv chunk)
def chunk_forward(
    q: Array,
    k: Array,
    v: Array,
    q_seg: Array,
    k_seg: Array,
    q_start: Array,
    k_start: Array,
    k_length: int,
    spec: AttentionSpec,
) -> tuple[Array, Array]:
    """Attention of a query chunk to one key/value chunk: (out, lse), out [nq, B, K, G, bq,
    H] float32 normalised over this chunk's keys, lse [nq, B, K, G, bq] (NEG-ish where a row
    sees none of them).

    q [nq, B, bq, K, G, H]; k, v [nk, B, bk, K, H]; q_seg [nq, B, bq]; k_seg [nk, B, bk].
    """
    need, first, last = needed_blocks(q_start, k_start, q_seg, k_seg, k_length, spec)
    _, b, bq, kh, g, h = q.shape
    k_end = k_start + k_length

    def query_block(xs):
        i, qb, qsb = xs
        q_index = q_start + i * spec.block_q + jnp.arange(bq)

        def key_block(j, carry):
            def compute(carry):
                m, row_sum, acc = carry
                k_index = k_start + j * spec.block_k + jnp.arange(spec.block_k)
                mask = block_mask(q_index, k_index, qsb, k_seg[j], k_end, spec)
                s, _ = block_scores(qb, k[j], spec)
                m_new = jnp.maximum(m, jnp.where(mask, s, NEG).max(axis=-1))
                p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
                correction = jnp.exp(m - m_new)
                pv = jnp.einsum(
                    "bkgqs,bskh->bkgqh", p.astype(v.dtype), v[j],
                    preferred_element_type=jnp.float32,
                )  # fmt: skip
                return m_new, row_sum * correction + p.sum(-1), acc * correction[..., None] + pv

            return lax.cond(need[i, j], compute, lambda c: c, carry)

        init = (
            jnp.full((b, kh, g, bq), NEG, jnp.float32),
            jnp.zeros((b, kh, g, bq), jnp.float32),
            jnp.zeros((b, kh, g, bq, h), jnp.float32),
        )
        m, row_sum, acc = lax.fori_loop(first[i], last[i] + 1, key_block, init)
        seen = row_sum > 0
        safe_sum = jnp.where(seen, row_sum, 1.0)
        return acc / safe_sum[..., None], jnp.where(seen, m + jnp.log(safe_sum), NEG)

    return lax.map(query_block, (jnp.arange(q.shape[0]), q, q_seg))


def chunk_backward(
    q: Array,
    k: Array,
    v: Array,
    q_seg: Array,
    k_seg: Array,
    q_start: Array,
    k_start: Array,
    k_length: int,
    lse: Array,
    delta: Array,
    d_out: Array,
    spec: AttentionSpec,
) -> tuple[Array, Array, Array]:
    """Gradients (dq [nq,B,bq,K,G,H], dk, dv [nk,B,bk,K,H], float32) of one chunk pair,
    recomputing each needed block's probabilities from the row ``lse`` of the whole softmax.

    delta = rowsum(d_out * out) [nq, B, K, G, bq]; d_out in the output's block layout.
    """
    need, first, last = needed_blocks(q_start, k_start, q_seg, k_seg, k_length, spec)
    bq = q.shape[2]
    k_end = k_start + k_length

    def query_block(carry, xs):
        i, qb, qsb, lse_b, delta_b, do_b = xs
        q_index = q_start + i * spec.block_q + jnp.arange(bq)

        def key_block(j, carry):
            def compute(carry):
                dq, dk, dv = carry
                kb, vb = k[j], v[j]
                k_index = k_start + j * spec.block_k + jnp.arange(spec.block_k)
                mask = block_mask(q_index, k_index, qsb, k_seg[j], k_end, spec)
                s, t = block_scores(qb, kb, spec)
                p = jnp.where(mask, jnp.exp(s - lse_b[..., None]), 0.0)
                dv_j = jnp.einsum("bkgqs,bkgqh->bskh", p.astype(do_b.dtype), do_b)
                dp = jnp.einsum("bkgqh,bskh->bkgqs", do_b, vb, preferred_element_type=jnp.float32)
                ds = p * (dp - delta_b[..., None])
                if t is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
                    ds = ds * (1.0 - t * t)
                ds = (ds * spec.scale).astype(qb.dtype)
                dq = dq + jnp.einsum(
                    "bkgqs,bskh->bqkgh", ds, kb, preferred_element_type=jnp.float32
                )
                dk_j = jnp.einsum("bkgqs,bqkgh->bskh", ds, qb, preferred_element_type=jnp.float32)
                dk = lax.dynamic_update_index_in_dim(dk, dk[j] + dk_j, j, 0)
                dv = lax.dynamic_update_index_in_dim(dv, dv[j] + dv_j.astype(jnp.float32), j, 0)
                return dq, dk, dv

            return lax.cond(need[i, j], compute, lambda c: c, carry)

        dk, dv = carry
        dq0 = jnp.zeros(qb.shape, jnp.float32)
        dq, dk, dv = lax.fori_loop(first[i], last[i] + 1, key_block, (dq0, dk, dv))
        return (dk, dv), dq

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    xs = (jnp.arange(q.shape[0]), q, q_seg, lse, delta, d_out)
    (dk, dv), dq = lax.scan(query_block, init, xs)
    return dq, dk, dv


def output_delta(out: Array, d_out: Array) -> Array:
    """rowsum(d_out * out) in float32: the softmax backward's per-row term (FA2's D)."""
    return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)


def blocked_inputs(
    q: Array, k: Array, v: Array, q_seg: Array, k_seg: Array, spec: AttentionSpec
) -> tuple[Array, Array, Array, Array, Array]:
    """q [nq, B, bq, K, G, H], k/v [nk, B, bk, K, H], segments [n, B, block]."""
    kh = k.shape[2]
    qb = blocked_tokens(q, spec.block_q)
    qb = qb.reshape(*qb.shape[:3], kh, q.shape[2] // kh, q.shape[3])
    return (
        qb,
        blocked_tokens(k, spec.block_k),
        blocked_tokens(v, spec.block_k),
        blocked_tokens(q_seg, spec.block_q),
        blocked_tokens(k_seg, spec.block_k),
    )


def unblocked_grads(
    dq: Array, dk: Array, dv: Array, q: Array, k: Array, v: Array
) -> tuple[Array, Array, Array]:
    """Block-layout float32 gradients back to the inputs' shapes and dtypes."""
    b, t, n, h = q.shape
    s = k.shape[1]
    dq = jnp.moveaxis(dq, 0, 1).reshape(b, -1, n, h)[:, :t]
    dk = jnp.moveaxis(dk, 0, 1).reshape(b, -1, *k.shape[2:])[:, :s]
    dv = jnp.moveaxis(dv, 0, 1).reshape(b, -1, *v.shape[2:])[:, :s]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ------------------------------------------------------------------ single-device custom_vjp
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q: Array, k: Array, v: Array, segment_ids: Array, spec: AttentionSpec) -> Array:
    return _attention_fwd(q, k, v, segment_ids, spec)[0]


def _attention_fwd(q, k, v, segment_ids, spec):
    qb, kb, vb, qs, ks = blocked_inputs(q, k, v, segment_ids, segment_ids, spec)
    zero = jnp.zeros((), jnp.int32)
    out, lse = chunk_forward(qb, kb, vb, qs, ks, zero, zero, k.shape[1], spec)
    result = unblocked(out, q.shape[1]).astype(q.dtype)
    return result, (q, k, v, segment_ids, result, lse)


def _attention_bwd(spec, residuals, d_out):
    q, k, v, segment_ids, out, lse = residuals
    qb, kb, vb, qs, ks = blocked_inputs(q, k, v, segment_ids, segment_ids, spec)
    kh = k.shape[2]
    do_b = to_block_layout(d_out, kh, spec.block_q)
    delta = output_delta(to_block_layout(out, kh, spec.block_q), do_b)
    zero = jnp.zeros((), jnp.int32)
    dq, dk, dv = chunk_backward(qb, kb, vb, qs, ks, zero, zero, k.shape[1], lse, delta, do_b, spec)
    return (*unblocked_grads(dq, dk, dv, q, k, v), None)


_attention.defvjp(_attention_fwd, _attention_bwd)
