"""Cached decoding for the Llama family and its mixture-of-experts: the forward pass of new
tokens against a KV cache.

The cache holds every layer's keys and values in fixed-size buffers [B, L, K, H] (L = prompt
+ new tokens), so the prefill and every decode step keep one shape and compile once. Prompts
of different lengths are left-padded: row b's first ``pad[b]`` slots are never attended to
and its positions start at 0 on its first real token, which is what the same prompt alone
would see (HF's left padding works the same way).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.models.layers import grouped_attention, rope_cos_sin, rope_inv_freq
from jaxtrain.models.llama import LlamaForCausalLM

__all__ = ["Cache", "cached_forward", "empty_cache", "supports_kv_cache"]

Cache = list[tuple[jax.Array, jax.Array]]  # per layer: (keys, values) [B, L, K, H]


def supports_kv_cache(model: Any) -> bool:
    """True for models whose layers this module knows how to run step by step: the Llama
    family and its mixture-of-experts (dropless routing: a capacity limit would drop other
    tokens over one step than over the whole sequence)."""
    from jaxtrain.models.moe import MoeForCausalLM

    if type(model) is MoeForCausalLM:
        return model.config.capacity_factor is None
    return type(model) is LlamaForCausalLM


def empty_cache(model: LlamaForCausalLM, batch: int, length: int) -> Cache:
    c = model.config
    shape = (batch, length, c.num_key_value_heads, c.head_dim)
    zeros = jnp.zeros(shape, model.dtype)
    return [(zeros, zeros) for _ in range(c.num_hidden_layers)]


def cached_forward(
    model: LlamaForCausalLM,
    ids: jax.Array,  # [B, T]: the tokens of slots start .. start + T - 1
    start: jax.Array,  # scalar int32: cache slot of ids[:, 0]
    pad: jax.Array,  # [B] int32: left-padding slots of each row
    cache: Cache,
) -> tuple[jax.Array, Cache]:
    """Logits [B, V] of the last of ``ids`` and the cache with their keys/values written."""
    c = model.config
    lm = model.model
    t = ids.shape[1]
    length = cache[0][0].shape[1]
    q_slot = start + jnp.arange(t, dtype=jnp.int32)
    k_slot = jnp.arange(length, dtype=jnp.int32)
    positions = jnp.maximum(q_slot[None, :] - pad[:, None], 0)  # [B, T]
    # Key j is visible to query i: not padding, not in the future, inside the window.
    visible = (k_slot[None, None, :] >= pad[:, None, None]) & (
        k_slot[None, None, :] <= q_slot[None, :, None]
    )
    if c.sliding_window is not None:
        visible &= (q_slot[:, None] - k_slot[None, :] < c.sliding_window)[None]
    mask = visible[:, None]  # [B, 1, T, L]

    cos, sin = rope_cos_sin(positions, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
                            lm.dtype)  # fmt: skip
    x = lm.embed_tokens(ids)
    new_cache: Cache = []
    for layer, (keys, values) in zip(lm.layers, cache):
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
        keys = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), start, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(values, v.astype(values.dtype), start, axis=1)
        out = grouped_attention(q, keys, values, mask)
        x = x + attn.o_proj(out)
        y = layer.mlp(layer.post_attention_layernorm(x))
        x = x + (y[0] if isinstance(y, tuple) else y)  # a sparse MoE block adds router stats
        new_cache.append((keys, values))
    h = lm.norm(x[:, -1:])  # only the last position needs logits
    logits = lm.embed_tokens.attend(h) if model.lm_head is None else model.lm_head(h)
    return logits[:, -1], new_cache
