"""Attention maths for [B, T, N, H] queries and [B, S, K, H] keys and values (grouped-query:
N % K == 0): causal attention for training (masks for packed documents and sliding windows,
query blocks, blockwise and ring attention for long rows in blockwise.py and ring.py, the
cuDNN kernel) and attention against a KV cache for decoding. The modules that project into
and out of it are in layers.py."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.models.blockwise import blockwise_attention
from jaxtrain.models.ring import SEQUENCE_AXIS, sequence_parallel_attention
from jaxtrain.models.sharding import current_rules, step_platform

Array = jax.Array


IMPLEMENTATIONS = (None, "xla", "blockwise", "cudnn")

# Rows from this length on run blockwise attention when no implementation is chosen. On CPU
# blockwise attention alone (fwd + bwd) was already faster than dense from 256 tokens on
# (2026-11-25); the model-level bench (bench/long_context.py) sets the line at 1k, where
# the dense [B, N, T, T] scores stop fitting in cache.
BLOCKWISE_MIN_LENGTH = 1024

# cuDNN's fused attention takes half-precision inputs with head_dim a multiple of 8 up to 128,
# on compute capability 8.0 (Ampere) and newer.
CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 128
CUDNN_MIN_CAPABILITY = 8.0


def default_implementation(
    *,
    platform: str,
    compute_capability: float | None,
    dtype: str,
    head_dim: int,
    length: int,
    logit_cap: float | None,
    sequence_parallel: bool,
) -> str:
    """What ``implementation=None`` runs. On an NVIDIA GPU, cuDNN's fused kernel wherever it
    applies: on one H100 it trained the 1.1B Llama at 4096 tokens 3.2x faster than blockwise
    and 3.7x faster than dense attention (bench/RESULTS.md, 2026-11-26). Elsewhere, and for
    float32, soft-capping or head sizes cuDNN refuses: blockwise from BLOCKWISE_MIN_LENGTH
    tokens on, dense below (blockwise turns into ring attention when sp > 1 splits the length,
    which the cuDNN kernel cannot follow)."""
    cudnn_fits = (
        platform == "gpu"
        and (compute_capability or 0.0) >= CUDNN_MIN_CAPABILITY
        and dtype in CUDNN_DTYPES
        and head_dim % 8 == 0
        and head_dim <= CUDNN_MAX_HEAD_DIM
        and logit_cap is None
    )
    if cudnn_fits and not sequence_parallel:
        return "cudnn"
    return "blockwise" if length >= BLOCKWISE_MIN_LENGTH else "xla"


def _sequence_parallel() -> bool:
    """Whether the enclosing activation rules split the length over sp > 1 devices."""
    rules = current_rules()
    return rules is not None and dict(rules.mesh.shape).get(SEQUENCE_AXIS, 1) > 1


def _resolve_default(q: Array, logit_cap: float | None) -> str:
    """default_implementation for these queries, on the devices the step runs on."""
    platform, capability = step_platform()
    sequence_parallel = _sequence_parallel()
    return default_implementation(
        platform=platform,
        compute_capability=capability,
        dtype=jnp.dtype(q.dtype).name,
        head_dim=q.shape[-1],
        length=q.shape[1],
        logit_cap=logit_cap,
        sequence_parallel=sequence_parallel,
    )


def padding_segments(attention_mask: Array | None) -> Array | None:
    """Segment ids for right-padded rows (1 up to a row's last real token, 0 on the padding
    after it) where blockwise attention reads them, else None.

    Real tokens attend only to earlier ones, so these ids change no real token's output.
    Blockwise attention (the default from BLOCKWISE_MIN_LENGTH tokens, ring attention under
    sp) then skips every block that is padding in all rows: short rows padded to a long
    length cost the attention of the batch's longest row. Not on a GPU without sp, where
    cuDNN (its default there) would take them as a dense [B, T, T] mask instead of running
    its causal kernel."""
    if attention_mask is None or attention_mask.shape[-1] < BLOCKWISE_MIN_LENGTH:
        return None
    if step_platform()[0] == "gpu" and not _sequence_parallel():
        return None
    real = (attention_mask != 0).astype(jnp.int32)
    # 1 where a real token lies at or after this position in the row.
    return (jnp.cumsum(real[:, ::-1], axis=1)[:, ::-1] > 0).astype(jnp.int32)


def causal_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    segment_ids: Array | None = None,
    sliding_window: int | None = None,
    implementation: str | None = None,
    scale: float | None = None,
    logit_cap: float | None = None,
    bidirectional_ids: Array | None = None,
) -> Array:
    """Causal (grouped-query) attention. q [B,T,N,H]; k, v [B,T,K,H] with N % K == 0.

    - segment_ids [B, T]: a token attends only to earlier tokens of its own segment, so
      packed documents stay independent.
    - sliding_window w: token i attends to j only when i - j < w (HF Mistral semantics),
      i.e. a left window of w - 1 in jax's inclusive ``local_window_size``.
    - ``scale`` (default 1 / sqrt(H)) and ``logit_cap`` (Gemma 2 soft-capping).
    - bidirectional_ids [B, T]: tokens of one id >= 0 (an image's tokens, Gemma 3) also see
      each other whatever their order; -1: causal only. Runs the masked "xla" path.
    ``implementation``: "xla" runs ``grouped_attention`` (the same maths as jax's XLA path,
    without its per-group vmap: that made XLA transpose the [B, N, T, T] scores of every
    layer); "blockwise" runs models/blockwise.py (online softmax, no T x T array), as ring
    attention (models/ring.py) when the activation rules split the length over sp > 1
    devices; None picks by ``default_implementation`` (cuDNN on NVIDIA GPUs where it applies,
    else "blockwise" from BLOCKWISE_MIN_LENGTH tokens on and "xla" below); "cudnn" runs ``jax.nn.dot_product_attention``'s fused GPU kernel (no soft-capping).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention_implementation={implementation!r}: choose one of {IMPLEMENTATIONS}."
        )
    if bidirectional_ids is not None:  # a mask no fused or blockwise kernel takes
        t, ids = q.shape[1], bidirectional_ids
        block = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] >= 0)
        if sliding_window is not None:  # the window bounds an image's keys too (as HF)
            block &= jnp.asarray(np.arange(t)[:, None] - np.arange(t)[None, :] < sliding_window)
        if segment_ids is not None:
            block &= same_segment_mask(segment_ids)[:, 0]
        mask = causal_mask(t, segment_ids=segment_ids, sliding_window=sliding_window)
        mask = mask | block[:, None]
        return grouped_attention(q, k, v, mask, scale=scale, logit_cap=logit_cap)
    if implementation is None:
        implementation = _resolve_default(q, logit_cap)
    if implementation == "cudnn":
        if logit_cap is not None:
            raise ValueError("attention_implementation='cudnn' has no logit soft-capping.")
        window = None if sliding_window is None else (sliding_window - 1, 0)
        mask = None if segment_ids is None else same_segment_mask(segment_ids)
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, is_causal=True, local_window_size=window,
            implementation="cudnn",
        )  # fmt: skip
    if implementation == "blockwise":
        kw = dict(
            segment_ids=segment_ids, sliding_window=sliding_window, scale=scale,
            logit_cap=logit_cap,
        )  # fmt: skip
        ring = sequence_parallel_attention(q, k, v, **kw)
        return blockwise_attention(q, k, v, **kw) if ring is None else ring
    mask = causal_mask(q.shape[1], segment_ids=segment_ids, sliding_window=sliding_window)
    return blocked_causal_attention(
        q, k, v, mask, sliding_window=sliding_window, scale=scale, logit_cap=logit_cap
    )


# Sequences from this length on run causal attention as two query blocks. Measured on CPU
# (bench/RESULTS.md, 2026-11-24): two blocks at seq 256 made the step 3.8% faster, four
# blocks of 128 at seq 512 gained nothing (their slices and concatenation cost as much).
MIN_BLOCKED_LENGTH = 256


def blocked_causal_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array,
    *,
    sliding_window: int | None = None,
    scale: float | None = None,
    logit_cap: float | None = None,
) -> Array:
    """``grouped_attention`` for a causal ``mask``, one query block at a time.

    A block of queries reads only the keys up to its own end (and not before its sliding
    window): with two blocks 3/4 of the T x T scores are computed instead of all of them,
    the same numbers as one full masked softmax.
    """
    t = q.shape[1]
    if t < MIN_BLOCKED_LENGTH or t % 2:
        return grouped_attention(q, k, v, mask, scale=scale, logit_cap=logit_cap)
    block = t // 2
    k, v = repeat_kv(k, v, q.shape[2])  # once here, not once per block
    outputs = []
    for start in range(0, t, block):
        end = start + block
        first = 0 if sliding_window is None else max(0, start - sliding_window + 1)
        first -= first % block  # whole blocks: the mask covers the rest
        block_mask = mask[:, :, start:end, first:end]
        outputs.append(
            grouped_attention(
                q[:, start:end],
                k[:, first:end],
                v[:, first:end],
                block_mask,
                scale=scale,
                logit_cap=logit_cap,
            )  # fmt: skip
        )
    return jnp.concatenate(outputs, axis=1)


def causal_mask(
    t: int, *, segment_ids: Array | None = None, sliding_window: int | None = None
) -> Array:
    """[1 or B, 1, T, T] bool: key j is visible to query i when j <= i (and i - j <
    sliding_window, and both lie in one segment). Without segments it is a constant."""
    offset = np.arange(t)[:, None] - np.arange(t)[None, :]  # query index - key index
    visible = offset >= 0
    if sliding_window is not None:
        visible &= offset < sliding_window
    mask = jnp.asarray(visible)[None, None]
    return mask if segment_ids is None else mask & same_segment_mask(segment_ids)


def same_segment_mask(segment_ids: Array) -> Array:
    """[B, 1, T, T] bool: query i and key j belong to the same segment (packed document)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def repeat_kv(k: Array, v: Array, num_heads: int) -> tuple[Array, Array]:
    """k, v [B, S, K, H] repeated to [B, S, num_heads, H]: head n reads kv head n // (N // K)."""
    groups = num_heads // k.shape[2]
    if groups == 1:
        return k, v
    return jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)


def grouped_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    *,
    scale: float | None = None,
    logit_cap: float | None = None,
) -> Array:
    """softmax(scale * q k) v with scores and softmax in float32; q [B,T,N,H], k/v
    [B,S,K,H]; mask broadcasts to [B, N, T, S] (True = visible; None: all visible).

    Query head n reads kv head n // (N // K) (HF's GQA grouping): k and v are repeated to
    N heads, which costs a q-sized copy and keeps every dot a plain 4-D batched matmul.
    ``scale`` defaults to 1 / sqrt(H); ``logit_cap`` soft-caps the scaled scores
    (cap * tanh(s / cap), Gemma 2).
    """
    k, v = repeat_kv(k, v, q.shape[2])
    if logit_cap is None:
        visible = jnp.ones((1, 1, 1, 1), bool) if mask is None else mask
        return softmax_attention(q, k, v, visible, q.shape[3] ** -0.5 if scale is None else scale)
    scores = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    probs = attention_probs(scores, q.shape[3], mask, scale=scale, logit_cap=logit_cap)
    return jnp.einsum("bnts,bsnh->btnh", probs.astype(v.dtype), v)


def _probs_and_output(q: Array, k: Array, v: Array, mask: Array, scale: float):
    scores = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    probs = attention_probs(scores, q.shape[3], mask, scale=scale)
    return probs, jnp.einsum("bnts,bsnh->btnh", probs.astype(v.dtype), v)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def softmax_attention(q: Array, k: Array, v: Array, mask: Array, scale: float) -> Array:
    """softmax(scale * q k, masked) v for q, k, v [B, T|S, N, H] (k and v already repeated to
    N heads) and a bool ``mask`` that broadcasts to [B, N, T, S]; scores and softmax in float32.

    Its own backward pass keeps one [B, N, T, S] array, the probabilities, where
    differentiating the softmax as written kept three (the masked scores, their exponentials
    and the probabilities) and a bool mask as large: 376 MB of the 1.7 GB of temporaries of the
    37.8M Llama's train step in bench/overhead.py, and the step ran 4% faster without them.
    With p = softmax(s): ds = p * (dp - sum(p * dp)) on the visible keys.
    """
    return _probs_and_output(q, k, v, mask, scale)[1]


def _softmax_attention_fwd(q, k, v, mask, scale):
    probs, out = _probs_and_output(q, k, v, mask, scale)
    return out, (q, k, v, mask, probs)


def _softmax_attention_bwd(scale, residuals, d_out):
    q, k, v, mask, probs = residuals
    d_v = jnp.einsum("bnts,btnh->bsnh", probs.astype(v.dtype), d_out.astype(v.dtype))
    d_probs = jnp.einsum("btnh,bsnh->bnts", d_out, v, preferred_element_type=jnp.float32)
    d_scores = probs * (d_probs - jnp.sum(probs * d_probs, axis=-1, keepdims=True)) * scale
    d_scores = jnp.where(mask, d_scores, 0.0)  # a row with no visible key has uniform probs
    d_q = jnp.einsum("bnts,bsnh->btnh", d_scores.astype(k.dtype), k)
    d_k = jnp.einsum("bnts,btnh->bsnh", d_scores.astype(q.dtype), q)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), None


softmax_attention.defvjp(_softmax_attention_fwd, _softmax_attention_bwd)


def attention_probs(
    scores: Array,
    head_dim: int,
    mask: Array | None,
    *,
    scale: float | None = None,
    logit_cap: float | None = None,
) -> Array:
    """float32 softmax over the last axis of raw q.k `scores`, scaled (default 1 / sqrt(H)),
    soft-capped and masked (`mask` True = visible, broadcast to the scores)."""
    scores = scores * (head_dim**-0.5 if scale is None else scale)
    if logit_cap is not None:
        scores = logit_cap * jnp.tanh(scores / logit_cap)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


def cache_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array,
    *,
    scale: float | None = None,
    logit_cap: float | None = None,
) -> Array:
    """``grouped_attention`` for a few queries against a KV cache: q [B,T,N,H], k/v [B,L,K,H].

    Each group of N // K query heads reads its kv head in place. Repeating the cache to N
    heads, as ``grouped_attention`` does for a training batch, would copy the whole cache in
    every decoding step. Without soft-capping this is jax's own XLA attention, which ran the
    demo model's decoding fastest (bench/RESULTS.md, 2026-11-25).
    """
    if logit_cap is None:
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    # mask [B, 1, T, L] -> [B, 1, 1, T, L]: the same for every head of a group
    probs = attention_probs(scores, h, mask[:, :, None], scale=scale, logit_cap=logit_cap)
    return jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v).reshape(b, t, n, h)
