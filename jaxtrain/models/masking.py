"""Padding masks on the model call: ``attention_mask`` becomes segments and positions.

A padded batch (HF convention: ``attention_mask`` [B, T], 1 = real token, 0 = padding,
usually on the left for generation) needs two things: real tokens must not attend to
padding, and each row's first real token must sit at position 0. Both reduce to what the
attention already supports for packing: padding forms its own segment (0), real tokens
segment ``segment_id + 1``, so no new mask path is needed in the attention kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def apply_padding_mask(
    attention_mask: Array | None,
    input_ids: Array,
    positions: Array | None,
    segment_ids: Array | None,
) -> tuple[Array | None, Array | None]:
    """(positions, segment_ids) with ``attention_mask`` folded in.

    Without an explicit ``positions``, a row's positions count its real tokens (padding
    keeps position 0), so a left-padded row is computed exactly like the unpadded one.
    Padded positions still get finite (meaningless) outputs: they attend to padding only.
    """
    if attention_mask is None:
        return positions, segment_ids
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
            f"{tuple(input_ids.shape)}; pass one 0/1 entry per token."
        )
    real = attention_mask != 0
    if positions is None:
        positions = jnp.maximum(jnp.cumsum(real.astype(jnp.int32), axis=1) - 1, 0)
    base = jnp.zeros_like(input_ids, jnp.int32) if segment_ids is None else segment_ids
    return positions, jnp.where(real, base.astype(jnp.int32) + 1, 0)


def unsampled_token_ids(model: object) -> tuple[int, ...]:
    """Tokens a model's generations never hold: a vision-language model's image placeholder
    (its embedding is an image's, which a generated token has none of). Its samplers draw
    from the other tokens, and its RL log-probs are of that same distribution."""
    token = getattr(getattr(model, "config", None), "image_token_id", None)
    return () if token is None else (int(token),)


def without_tokens(logits: Array, token_ids: tuple[int, ...]) -> Array:
    """`logits` [..., V] with `token_ids` at -inf (never drawn, no probability)."""
    if not token_ids:
        return logits
    return logits.at[..., jnp.asarray(token_ids)].set(-jnp.inf)
