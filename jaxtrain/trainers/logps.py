"""Per-token and per-sequence log-probabilities of labelled tokens (pure, jit-friendly)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.training.step import CHUNK_LOGITS, CHUNKED_LOSS_MIN_VOCAB


def token_logps(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log p(label) [B, T-1] (0 where ignored), mask [B, T-1]); logits[:, t] predicts
    labels[:, t + 1], as in the causal LM loss."""
    logits_BxTxV = logits[:, :-1].astype(jnp.float32)
    targets_BxT = labels[:, 1:]
    mask_BxT = targets_BxT != IGNORE_INDEX
    safe = jnp.where(mask_BxT, targets_BxT, 0)
    picked = jnp.take_along_axis(logits_BxTxV, safe[..., None], axis=-1)[..., 0]
    logp = picked - jax.nn.logsumexp(logits_BxTxV, axis=-1)
    return jnp.where(mask_BxT, logp, 0.0), mask_BxT


def lm_logits(model: Any, input_ids: jax.Array) -> jax.Array:
    """Logits of a causal LM on right-padded rows (padding sits after every real token, so
    causal attention never lets a real token see it)."""
    return model(input_ids)


def sequence_logps(model: Any, input_ids: jax.Array, labels: jax.Array):
    """(sum of log p over each row's labelled tokens [B], labelled token count [B]).

    Models with ``hidden_states`` and ``output_projection`` and a vocabulary of at least
    CHUNKED_LOSS_MIN_VOCAB get the same sums a chunk of positions at a time, so no
    [B, T, V] float32 logits exist (as the chunked causal LM loss does).
    """
    vocab = getattr(getattr(model, "config", None), "vocab_size", 0)
    chunked = hasattr(model, "hidden_states") and hasattr(model, "output_projection")
    if chunked and vocab >= CHUNKED_LOSS_MIN_VOCAB:
        hidden = model.hidden_states(input_ids)
        positions = max(1, CHUNK_LOGITS // (vocab * input_ids.shape[0]))
        return chunked_sequence_logps(
            hidden, model.output_projection(), labels, chunk_positions=positions
        )
    logp, mask = token_logps(lm_logits(model, input_ids), labels)
    return logp.sum(-1), mask.sum(-1).astype(jnp.float32)


def chunked_sequence_logps(
    hidden: jax.Array,
    project: Callable[[jax.Array], jax.Array],
    labels: jax.Array,
    *,
    chunk_positions: int,
) -> tuple[jax.Array, jax.Array]:
    """``sequence_logps`` from hidden states [B, T, D], ``chunk_positions`` positions of
    every row at a time; each chunk's logits exist only inside a rematerialised scan step."""
    b, t, d = hidden.shape
    h = hidden[:, :-1]
    targets = labels[:, 1:]
    chunk = min(chunk_positions, t - 1)
    chunks = -(-(t - 1) // chunk)
    pad = chunks * chunk - (t - 1)
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, chunks, chunk, d)
    targets = jnp.pad(targets, ((0, 0), (0, pad)), constant_values=IGNORE_INDEX)
    targets = targets.reshape(b, chunks, chunk)

    @jax.checkpoint
    def chunk_logps(h_c: jax.Array, t_c: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = project(h_c).astype(jnp.float32)  # [B, chunk, V]
        mask = t_c != IGNORE_INDEX
        picked = jnp.take_along_axis(logits, jnp.where(mask, t_c, 0)[..., None], axis=-1)
        logp = picked[..., 0] - jax.nn.logsumexp(logits, axis=-1)
        return jnp.where(mask, logp, 0.0).sum(-1), mask.sum(-1).astype(jnp.float32)

    def body(carry, xs):
        logp, tokens = chunk_logps(*xs)
        return (carry[0] + logp, carry[1] + tokens), None

    zero = jnp.zeros((b,), jnp.float32)
    (logp, tokens), _ = jax.lax.scan(
        body, (zero, zero), (jnp.moveaxis(h, 1, 0), jnp.moveaxis(targets, 1, 0))
    )
    return logp, tokens


def pair_mask(labels: jax.Array) -> jax.Array:
    """Rows that hold a real pair ([..., T] labels -> [...] bool); filler rows are all -100."""
    return (labels[..., 1:] != IGNORE_INDEX).any(-1)
