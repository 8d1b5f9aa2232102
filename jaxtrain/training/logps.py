"""Log-probabilities of labelled tokens: the one home of the maths and of its chunking.

Every objective that scores labels under a causal LM (the LM loss, SFT, distillation's
cross-entropy, DPO, GRPO) reads them from here:

- ``target_logps`` is the formula: log p(target) per position from logits [..., V];
- ``token_logps`` applies it to a batch's whole logits [B, T, V];
- at a large vocabulary, ``chunked_token_logps`` and ``chunked_logp_sums`` apply it to a
  chunk of positions at a time (``_token_chunks``), projecting the hidden states to logits
  inside one scan step, so no [B, T, V] float32 array ever exists.

The two chunked functions differ only in how they are differentiated. ``chunked_token_logps``
returns per-token log-probs [B, T-1] for any downstream weighting (DPO's per-row terms,
GRPO's per-token advantages), so its backward pass recomputes each chunk's logits
(jax.checkpoint). ``chunked_logp_sums`` returns their sum (the LM loss): one scalar
cotangent scales every token alike, so the chunk's gradient is formed in the forward pass
and the backward only scales it (0.98x the step time of whole-batch logits against 1.29x
with recompute, bench/RESULTS.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.models.masking import unsampled_token_ids, without_tokens
from jaxtrain.models.sharding import constrain, current_rules

# Vocabularies from this size on get chunked log-probs: float32 logits of a whole batch
# would dominate memory (vocab 49152, batch 8 x 512: 805 MB, and as much again for their
# gradient).
CHUNKED_LOSS_MIN_VOCAB = 32768
# Target float32 logits per chunk (elements): 2**24 = 64 MiB.
CHUNK_LOGITS = 2**24
# Whole-batch logits above this many elements (256 MiB in float32) are chunked at any
# vocabulary: a 32k-token row at vocab 32000 would otherwise hold 4 GiB of logits.
LONG_ROW_LOGITS = 2**26


def target_logps(
    logits: jax.Array, targets: jax.Array, *, entropy: bool = False
) -> tuple[jax.Array, ...]:
    """(log p(target), mask, target is the top logit), each [...], from logits [..., V];
    with ``entropy``, a fourth: the entropy of the distribution at each position (0 where
    masked, no gradient: it is logged, not optimised).

    Targets equal to IGNORE_INDEX are masked: their log-prob is 0 and they are never top.
    """
    logits = logits.astype(jnp.float32)
    mask = targets != IGNORE_INDEX
    safe = jnp.where(mask, targets, 0)
    log_norm = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    logp = jnp.where(mask, target_logit - log_norm, 0.0)
    # The target is the model's top guess when its logit is the maximum (ties count as right).
    # Cheaper than argmax, which XLA:CPU does not vectorise (~2% of a small model's step).
    top = (target_logit >= logits.max(axis=-1)) & mask
    if not entropy:
        return logp, mask, top
    # H = log Z - E_p[logit], from the log-normaliser already formed: no second softmax.
    logits = jax.lax.stop_gradient(logits)
    probs = jnp.exp(logits - jax.lax.stop_gradient(log_norm)[..., None])
    ent = jax.lax.stop_gradient(log_norm) - (probs * logits).sum(-1)
    return logp, mask, top, jnp.where(mask, ent, 0.0)


def next_token_targets(labels: jax.Array) -> jax.Array:
    """[B, T] targets of logits [B, T, V]: labels[:, t + 1], IGNORE_INDEX at the last position.

    The last position is masked, not sliced off: slicing [B, T, V] logits costs a
    logits-sized copy forward and a pad of their gradient backward.
    """
    ignore = jnp.full_like(labels[:, :1], IGNORE_INDEX)
    return jnp.concatenate([labels[:, 1:], ignore], axis=1)


def token_logps(
    logits: jax.Array, labels: jax.Array, *, entropy: bool = False
) -> tuple[jax.Array, ...]:
    """(log p(label) [B, T-1] (0 where ignored), mask [B, T-1]) from whole logits [B, T, V];
    logits[:, t] predicts labels[:, t + 1], as in the causal LM loss. With ``entropy``, a
    third: each labelled position's entropy [B, T-1] (0 where ignored)."""
    out = target_logps(logits, next_token_targets(labels), entropy=entropy)
    logp, mask = out[0][:, :-1], out[1][:, :-1]
    return (logp, mask, out[3][:, :-1]) if entropy else (logp, mask)


def chunks_logits(model: Any, tokens: int = 0) -> bool:
    """Whether `model`'s log-probs are computed a chunk at a time: a model that exposes
    ``hidden_states`` and ``output_projection`` (the Llama family) with a vocabulary of at
    least CHUNKED_LOSS_MIN_VOCAB, or a batch of ``tokens`` positions whose whole logits
    would exceed LONG_ROW_LOGITS (long-context rows at any vocabulary)."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0) or 0
    heads = hasattr(model, "hidden_states") and hasattr(model, "output_projection")
    return heads and (vocab >= CHUNKED_LOSS_MIN_VOCAB or tokens * vocab > LONG_ROW_LOGITS)


def chunk_tokens_for(vocab: int) -> int:
    """Positions per chunk: CHUNK_LOGITS float32 logits, a multiple of 64 positions."""
    return max(64, CHUNK_LOGITS // vocab // 64 * 64)


def model_token_logps(
    model: Any,
    input_ids: jax.Array,
    labels: jax.Array,
    *,
    entropy: bool = False,
    temperature: float = 1.0,
    pixel_values: jax.Array | None = None,
    routing: jax.Array | None = None,
) -> tuple[jax.Array, ...]:
    """``token_logps`` of a causal LM on ``input_ids`` (right-padded rows: causal attention
    never lets a real token see the padding), chunked when ``chunks_logits(model)``; with
    ``entropy`` the per-position entropies too, from the same logits. `temperature`: of
    softmax(logits / temperature), the distribution a sampler at that temperature draws from
    (GRPO's policy, old and reference log-probs, as TRL computes them). `pixel_values`: a
    vision-language model's image slots of the rows (data/vision.py). `routing` [B, S, T, k]:
    a mixture-of-experts policy's experts to replay (a sampler's: GRPO's routing_replay)."""
    inputs = {"pixel_values": pixel_values, "routing": routing}
    given = {k: v for k, v in inputs.items() if v is not None}
    unsampled = unsampled_token_ids(model)  # as the samplers draw (models/masking.py)
    if chunks_logits(model, input_ids.size):
        hidden = model.hidden_states(input_ids, **given)
        chunk = chunk_tokens_for(model.config.vocab_size)
        project = model.output_projection()
        if temperature != 1.0 or unsampled:
            unscaled = project

            def project(h: jax.Array) -> jax.Array:
                return without_tokens(unscaled(h), unsampled) / temperature

        return chunked_token_logps(hidden, project, labels, chunk_tokens=chunk, entropy=entropy)
    logits = without_tokens(model(input_ids, **given), unsampled)
    if temperature != 1.0:
        logits = logits / temperature
    return token_logps(logits, labels, entropy=entropy)


def sequence_logps(model: Any, input_ids: jax.Array, labels: jax.Array):
    """(sum of log p over each row's labelled tokens [B], labelled token count [B])."""
    logp, mask = model_token_logps(model, input_ids, labels)
    return logp.sum(-1), mask.sum(-1).astype(jnp.float32)


def pair_mask(labels: jax.Array) -> jax.Array:
    """Rows that hold a real pair ([..., T] labels -> [...] bool); filler rows are all -100."""
    return (labels[..., 1:] != IGNORE_INDEX).any(-1)


# ------------------------------------------------------------------ chunked over the vocabulary
def _shards(size: int, name: str) -> int:
    """Devices an activation axis of `size` named `name` ("batch", "length") is split over in
    the enclosing activation_sharding block (1 outside one, or where it does not divide)."""
    rules = current_rules()
    if rules is None:
        return 1
    axes = rules.activation_spec((size,), (name,))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(rules.mesh.shape[a] for a in axes)


def _token_chunks(
    hidden: jax.Array, labels: jax.Array, chunk_tokens: int
) -> tuple[jax.Array, jax.Array, int]:
    """(hidden [C, B, n, D], targets [C, B, n], sequence shards S): each row's T positions
    (the last one predicts nothing: its target is ignored) in C chunks of n.

    The chunks keep the activations where they are. A chunk keeps every row, so the rows stay
    split over the batch axes: flattening the rows into one token axis let the partitioner
    gather every device's hidden states onto every device (a 70B fsdp plan on 256 devices
    showed 34 GB per device). And with the sequence split over S devices (sp), a chunk takes
    n / S positions from each device's own part of the row: chunks of consecutive positions
    had every device gather the whole row and compute all of its logits (an 8-device 32k-token
    run did 8x the output head's work). n is set so one device's chunk holds about
    chunk_tokens positions; each device pads its part to C x n / S positions."""
    b, t, d = hidden.shape
    shards = _shards(t, "length")
    local = t // shards
    local_rows = max(b // _shards(b, "batch"), 1)
    per_shard = max(min(-(-chunk_tokens // local_rows), local), 1)
    chunks = -(-local // per_shard)
    # The targets move one position left, not the hidden states: [B, T] ints, not [B, T, D].
    targets = next_token_targets(labels)

    def split(x: jax.Array, fill: int, names: tuple) -> jax.Array:
        """[B, T, ...] -> [C, B, S x per_shard, ...], each device's positions kept on it."""
        rest = x.shape[2:]
        x = constrain(x.reshape(b, shards, local, *rest), ("batch", "length", None, *names))
        pad = [(0, 0), (0, 0), (0, chunks * per_shard - local)] + [(0, 0)] * len(rest)
        x = jnp.pad(x, pad, constant_values=fill).reshape(b, shards, chunks, per_shard, *rest)
        x = jnp.moveaxis(x, 2, 0).reshape(chunks, b, shards * per_shard, *rest)
        return constrain(x, (None, "batch", "length", *names))

    return split(hidden, 0, (None,)), split(targets, IGNORE_INDEX, ()), shards


def _unchunk(x: jax.Array, t: int, shards: int) -> jax.Array:
    """[C, B, n] per-chunk values (of `_token_chunks`' layout) -> [B, T-1]."""
    chunks, b, n = x.shape
    x = jnp.moveaxis(x.reshape(chunks, b, shards, n // shards), 0, 2)
    return x.reshape(b, shards, -1)[:, :, : t // shards].reshape(b, t)[:, : t - 1]


def _chunk_logps(head: Callable, h_c, t_c, *weights, entropy: bool = False) -> tuple:
    """``target_logps`` of one chunk: the only place a chunk's logits exist."""
    return target_logps(head(h_c, *weights), t_c, entropy=entropy)


def chunked_token_logps(
    hidden: jax.Array,
    project: Callable[[jax.Array], jax.Array],
    labels: jax.Array,
    *,
    chunk_tokens: int,
    entropy: bool = False,
) -> tuple[jax.Array, ...]:
    """``token_logps`` from hidden states [B, T, D], ``chunk_tokens`` positions at a time
    (with ``entropy``, the entropies too, from the same chunk's logits).

    ``project`` maps hidden states to logits (the model's output head). Differentiable for
    any cotangent: the backward pass recomputes each chunk's logits.
    """
    t = hidden.shape[1]
    h, targets, shards = _token_chunks(hidden, labels, chunk_tokens)
    head, weights = jax.closure_convert(project, h[0])
    chunk_logps = jax.checkpoint(
        functools.partial(_chunk_logps, entropy=entropy), static_argnums=(0,)
    )

    def body(carry, xs):
        out = chunk_logps(head, *xs, *weights)
        return carry, (out[0], out[3] if entropy else None)

    _, (logp, ent) = jax.lax.scan(body, None, (h, targets))
    mask = labels[:, 1:] != IGNORE_INDEX
    if entropy:
        return _unchunk(logp, t, shards), mask, _unchunk(ent, t, shards)
    return _unchunk(logp, t, shards), mask


def chunked_logp_sums(
    hidden: jax.Array,
    project: Callable[[jax.Array], jax.Array],
    labels: jax.Array,
    *,
    chunk_tokens: int,
) -> dict[str, jax.Array]:
    """Sums over ``chunked_token_logps``: {"logp_sum", "top" (targets that are the top
    logit), "tokens"}, with the gradient of "logp_sum" formed in the forward pass; and per
    row [B], "row_logp" and "row_tokens" (for per-row logs such as a mixture's per-source
    loss: they carry no gradient, so use them under stop_gradient).

    Each chunk's vjp is taken where its logits exist, for the hidden states and for the
    head's weights (Liger's fused linear cross-entropy does the same); the backward pass
    only scales them by the one scalar cotangent.
    """
    h, targets, _ = _token_chunks(hidden, labels, chunk_tokens)
    # The head's weights become explicit arguments, so the gradient can be formed for them.
    head, weights = jax.closure_convert(project, h[0])
    return _fused_logp_sums(head, h, targets, *weights)


def _chunk_sums(head: Callable, h_c, t_c, *weights) -> dict[str, jax.Array]:
    logp, mask, top = _chunk_logps(head, h_c, t_c, *weights)
    return {
        "logp_sum": logp.sum(),
        "top": top.sum().astype(jnp.float32),
        "tokens": mask.sum().astype(jnp.float32),
        # A chunk keeps every row ([B, n]): per-row sums cost a [B] add per chunk.
        "row_logp": logp.sum(-1),
        "row_tokens": mask.sum(-1).astype(jnp.float32),
    }


def _zero_sums(rows: int) -> dict[str, jax.Array]:
    zero, zeros = jnp.zeros((), jnp.float32), jnp.zeros((rows,), jnp.float32)
    return {"logp_sum": zero, "top": zero, "tokens": zero, "row_logp": zeros, "row_tokens": zeros}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused_logp_sums(head: Callable, h, targets, *weights) -> dict[str, jax.Array]:
    def body(carry, xs):
        return jax.tree.map(jnp.add, carry, _chunk_sums(head, *xs, *weights)), None

    sums, _ = jax.lax.scan(body, _zero_sums(h.shape[1]), (h, targets))
    return sums


def _fused_logp_sums_fwd(head: Callable, h, targets, *weights):
    # With symbolic zeros each argument says whether it is differentiated: a frozen head
    # (LoRA's base, a teacher) gets no gradient, so none is formed or accumulated for it.
    trained = [w.perturbed for w in weights]
    h, targets, weights = h.value, targets.value, [w.value for w in weights]

    def body(carry, xs):
        sums_acc, grads_acc = carry
        h_c, t_c = xs
        sums, vjp = jax.vjp(lambda h_c, *w: _chunk_sums(head, h_c, t_c, *w), h_c, *weights)
        # d logp_sum only: tokens and top are counts, the per-row sums are for logs.
        no_rows = jnp.zeros_like(sums["row_logp"])
        d_h, *d_weights = vjp(
            {"logp_sum": 1.0, "top": 0.0, "tokens": 0.0, "row_logp": no_rows,
             "row_tokens": no_rows}
        )  # fmt: skip
        d_weights = [g for g, t in zip(d_weights, trained) if t]
        grads_acc = [a + g.astype(jnp.float32) for a, g in zip(grads_acc, d_weights)]
        return (jax.tree.map(jnp.add, sums_acc, sums), grads_acc), d_h

    zero_grads = [jnp.zeros_like(w, jnp.float32) for w, t in zip(weights, trained) if t]
    zero_sums = _zero_sums(h.shape[1])
    (sums, d_weights), d_h = jax.lax.scan(body, (zero_sums, zero_grads), (h, targets))
    grads = iter(d_weights)
    d_weights = [next(grads).astype(w.dtype) if t else None for w, t in zip(weights, trained)]
    return sums, (d_h, d_weights)


def _fused_logp_sums_bwd(head: Callable, residuals, cotangent):
    d_h, d_weights = residuals
    if not isinstance(cotangent["row_logp"], SymbolicZero):
        # The head's gradient is summed over every token in the forward pass; a per-row
        # weighting of it cannot be undone here.
        raise ValueError(
            "chunked_logp_sums' row_logp carries no gradient; take it under "
            "jax.lax.stop_gradient (or use chunked_token_logps for per-token gradients)"
        )
    scale = cotangent["logp_sum"]  # the sums are linear in it; counts carry no gradient
    if isinstance(scale, SymbolicZero):
        return (None, None, *(None for _ in d_weights))
    return (
        d_h * scale.astype(d_h.dtype),
        None,
        *(None if g is None else g * scale.astype(g.dtype) for g in d_weights),
    )


_fused_logp_sums.defvjp(_fused_logp_sums_fwd, _fused_logp_sums_bwd, symbolic_zeros=True)
