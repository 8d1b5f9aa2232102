"""Per-token and per-sequence log-probabilities of labelled tokens (pure, jit-friendly)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.data.collate import IGNORE_INDEX


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
    """(sum of log p over each row's labelled tokens [B], labelled token count [B])."""
    logp, mask = token_logps(lm_logits(model, input_ids), labels)
    return logp.sum(-1), mask.sum(-1).astype(jnp.float32)


def pair_mask(labels: jax.Array) -> jax.Array:
    """Rows that hold a real pair ([..., T] labels -> [...] bool); filler rows are all -100."""
    return (labels[..., 1:] != IGNORE_INDEX).any(-1)
