"""Cached decoding: the forward pass of new tokens against a KV cache, for the Llama family
and its mixture-of-experts, Gemma 2 / 3 (with images too) and GPT-2.

The cache holds every layer's keys and values in fixed-size buffers [B, L, K, H] (L = prompt
+ new tokens), so the prefill and every decode step keep one shape and compile once. Prompts
of different lengths are left-padded: row b's first ``pad[b]`` slots are never attended to
and its positions start at 0 on its first real token, which is what the same prompt alone
would see (HF's left padding works the same way).

Each family's decoder is run layer by layer with the model's own modules (its attention's
``project``, norms, MLPs and output head), so the cached path computes what the full forward
computes; only where keys come from (the cache) and which ones are visible (``Slots.mask``)
differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.models.attention import cache_attention
from jaxtrain.models.gemma import GemmaForCausalLM
from jaxtrain.models.gemma3_vlm import Gemma3ForConditionalGeneration
from jaxtrain.models.gpt2 import GPT2LMHeadModel
from jaxtrain.models.layers import rope_cos_sin, rope_inv_freq
from jaxtrain.models.llama import LlamaForCausalLM
from jaxtrain.models.masking import unsampled_token_ids, without_tokens

__all__ = [
    "Cache",
    "Slots",
    "cached_forward",
    "decode_with_slots",
    "empty_cache",
    "supports_kv_cache",
]

Array = jax.Array
# Per layer: (keys, values) [B, L, K, H]; the serving engine's pool may add a MoE layer's
# recorded experts (serving/paged.py, `write_routing`).
Cache = list[tuple[Array, ...]]


@dataclass(frozen=True)
class Slots:
    """Where T new tokens sit in a cache of L slots: their positions and what they see."""

    start: Array  # scalar int32: cache slot of the first new token
    positions: Array  # [B, T]: each row's real tokens numbered from 0
    visible: Array  # [B, T, L]: key slot j is visible to query i (not padding, not future)
    distance: Array  # [T, L]: query slot - key slot

    @classmethod
    def of(cls, t: int, start: Array, pad: Array, length: int) -> Slots:
        q_slot = start + jnp.arange(t, dtype=jnp.int32)
        k_slot = jnp.arange(length, dtype=jnp.int32)
        positions = jnp.maximum(q_slot[None, :] - pad[:, None], 0)
        visible = (k_slot[None, None, :] >= pad[:, None, None]) & (
            k_slot[None, None, :] <= q_slot[None, :, None]
        )
        return cls(start, positions, visible, q_slot[:, None] - k_slot[None, :])

    @property
    def key_index(self) -> Array:
        """[B, T]: the key column each new token is written to."""
        t = self.distance.shape[0]
        return jnp.broadcast_to(self.start + jnp.arange(t, dtype=jnp.int32), self.positions.shape)

    @property
    def key_count(self) -> int:
        return self.distance.shape[1]

    def mask(self, window: int | None = None) -> Array:
        """[B, 1, T, L]; with a sliding `window`, only keys less than `window` slots back."""
        visible = self.visible if window is None else self.visible & (self.distance < window)[None]
        return visible[:, None]

    def write(self, layer_cache: tuple[Array, Array], k: Array, v: Array) -> tuple[Array, Array]:
        """The layer's cache with the new tokens' keys and values [B, T, K, H] written in."""
        keys, values = layer_cache
        update = jax.lax.dynamic_update_slice_in_dim
        return (
            update(keys, k.astype(keys.dtype), self.start, axis=1),
            update(values, v.astype(values.dtype), self.start, axis=1),
        )

    def read(self, keys: Array, values: Array) -> tuple[Array, Array]:
        """Each row's keys and values [B, L, K, H] as attention reads them: this cache's
        rows are contiguous already (a paged cache, jaxtrain/serving, gathers its pages)."""
        return keys, values

    def attention(self, q: Array, keys: Array, values: Array, mask: Array, **kw: Any) -> Array:
        """The new tokens' attention [B, T, N, H] over the cache (`mask`: self.mask(window);
        kw: window, scale, logit_cap). A paged cache may read its pages in place instead."""
        kw.pop("window", None)
        return cache_attention(q, *self.read(keys, values), mask, **kw)


# (model, ids, slots, cache, every) -> (logits [B, V] of the last token, or [B, T, V] of
# every token with `every`, and the new cache)
Decoder = Callable[[Any, Array, Slots, Cache, bool], tuple[Array, Cache]]


def _head_input(x: Array, every: bool) -> Array:
    """The positions whose logits are needed: the last only, unless `every` (a speculative
    step verifies each drafted token)."""
    return x if every else x[:, -1:]


def _head_output(logits: Array, every: bool) -> Array:
    return logits if every else logits[:, -1]


def _llama(model: LlamaForCausalLM, ids: Array, slots: Slots, cache: Cache, every=False):
    c, lm = model.config, model.model
    inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    cos, sin = rope_cos_sin(slots.positions, inv_freq, lm.dtype)
    mask = slots.mask(c.sliding_window)
    x = lm.embed_tokens(ids)
    new_cache: Cache = []
    for layer, layer_cache in zip(lm.layers, cache):
        attn = layer.self_attn
        q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
        keys, values = slots.write(layer_cache[:2], k, v)
        out = slots.attention(q, keys, values, mask, window=c.sliding_window)
        x = x + attn.o_proj(out)
        y = layer.mlp(layer.post_attention_layernorm(x))
        routes = ()
        if isinstance(y, tuple):  # a sparse MoE block: (y, what its router did)
            y, router = y
            if len(layer_cache) == 3:  # a pool that records each token's experts
                routes = (slots.write_routing(layer_cache[2], router.experts),)
        x = x + y
        new_cache.append((keys, values, *routes))
    h = lm.norm(_head_input(x, every))
    logits = lm.embed_tokens.attend(h) if model.lm_head is None else model.lm_head(h)
    return _head_output(logits, every), new_cache


def _gemma(
    model: GemmaForCausalLM, ids: Array, slots: Slots, cache: Cache, every=False, images=None
):
    """`images`: (the embeddings with an image's tokens in place [B, T, D], each token's image
    block [B, T]) of a Gemma 3 vision prompt, whose image tokens see each other both ways."""
    lm = model.model
    tables = lm.rope_tables(slots.positions)
    x = lm.embed(ids) if images is None else images[0]
    new_cache: Cache = []
    for layer, layer_cache in zip(lm.layers, cache):
        attn = layer.self_attn
        cos, sin = tables[layer.sliding]
        q, k, v = attn.project(layer.input_layernorm(x), cos, sin)
        keys, values = slots.write(layer_cache, k, v)
        mask = slots.mask(attn.window)
        if images is not None:
            mask = mask | _image_blocks(images[1], slots, attn.window)
        out = slots.attention(
            q, keys, values, mask, window=attn.window, scale=attn.scale, logit_cap=attn.cap
        )
        x = x + layer.post_attention_layernorm(attn.o_proj(out))
        h = layer.mlp(layer.pre_feedforward_layernorm(x))
        x = x + layer.post_feedforward_layernorm(h)
        new_cache.append((keys, values))
    logits = model.output_projection()(lm.norm(_head_input(x, every)))
    return _head_output(logits, every), new_cache


def _image_blocks(blocks: Array, slots: Any, window: int | None) -> Array:
    """[B, 1, T, L]: the new tokens of one image (`blocks` [B, T], as
    models/gemma3_vlm.image_blocks) see each other, wherever the slots put them (an image is
    never split across calls); within a sliding `window`, as the full forward."""
    index = slots.key_index  # [B, T]: each new token's key column, -1 for padding
    rows = jnp.arange(blocks.shape[0])[:, None]
    key_block = jnp.full((blocks.shape[0], slots.key_count), -1, jnp.int32)
    key_block = key_block.at[rows, jnp.maximum(index, 0)].max(jnp.where(index >= 0, blocks, -1))
    keys = (blocks[:, :, None] == key_block[:, None, :]) & (blocks[:, :, None] >= 0)
    if window is not None:
        columns = jnp.arange(slots.key_count, dtype=jnp.int32)
        keys &= index[:, :, None] - columns[None, None, :] < window
    return keys[:, None]


def _gemma3_vlm(
    model: Gemma3ForConditionalGeneration, ids, slots, cache, every=False, pixel_values=None
):
    """Gemma 3 with images: a prompt's images enter as their soft tokens; later tokens read
    them from the cache like any other."""
    images = None if pixel_values is None else model.embeddings(ids, pixel_values)
    return _gemma(model.language_model, ids, slots, cache, every, images)


def _gpt2(model: GPT2LMHeadModel, ids: Array, slots: Slots, cache: Cache, every=False):
    m = model.transformer
    mask = slots.mask()
    x = m.embed(ids, slots.positions)
    new_cache: Cache = []
    for block, layer_cache in zip(m.h, cache):
        q, k, v = block.attn.project(block.ln_1(x))
        keys, values = slots.write(layer_cache, k, v)
        x = x + block.attn.c_proj(slots.attention(q, keys, values, mask))
        x = x + block.mlp(block.ln_2(x))
        new_cache.append((keys, values))
    return _head_output(m.wte.attend(m.ln_f(_head_input(x, every))), every), new_cache


def _decoder(model: Any) -> Decoder | None:
    from jaxtrain.models.moe import MoeForCausalLM

    if type(model) is MoeForCausalLM:
        # Dropless routing only: a capacity limit would drop other tokens over one step than
        # over the whole sequence.
        return _llama if model.config.capacity_factor is None else None
    decoders: dict[type, Decoder] = {
        LlamaForCausalLM: _llama,
        GemmaForCausalLM: _gemma,
        GPT2LMHeadModel: _gpt2,
        Gemma3ForConditionalGeneration: _gemma3_vlm,
    }
    return decoders.get(type(model))


def decode_with_slots(
    model: Any,
    ids: Array,
    slots: Any,
    cache: Cache,
    *,
    every: bool = False,
    pixel_values: Array | None = None,
) -> tuple[Array, Cache]:
    """The family's cached forward of `ids` with a `slots` object of its own (Slots' interface:
    positions, key_index, key_count, mask(window), write, read): logits [B, V] of the last
    token (with `every`, [B, T, V] of every token) and the new cache. The serving engine's
    paged cache goes through here. `pixel_values` [B, K, C, H, W]: the images whose tokens
    `ids` hold, each whole (a vision-language model). Tokens a model never generates
    (`masking.unsampled_token_ids`: an image placeholder) get no probability."""
    decoder = _decoder(model)
    if pixel_values is None:
        logits, cache = decoder(model, ids, slots, cache, every)
    elif decoder is not _gemma3_vlm:
        raise ValueError(f"{type(model).__name__} takes no images; drop pixel_values.")
    else:
        logits, cache = decoder(model, ids, slots, cache, every, pixel_values)
    return without_tokens(logits, unsampled_token_ids(model)), cache


def supports_kv_cache(model: Any) -> bool:
    """True for the models this module can run token by token: the Llama family (Llama,
    Mistral, Qwen 2 / 3), its dropless mixture-of-experts, Gemma 2 / 3 and GPT-2."""
    return _decoder(model) is not None


def empty_cache(model: Any, batch: int, length: int) -> Cache:
    c = model.config
    if isinstance(model, GPT2LMHeadModel) and length > c.max_position_embeddings:
        raise ValueError(  # learned positions: there is no embedding past the table
            f"prompt + max_new_tokens = {length} exceeds max_position_embeddings "
            f"({c.max_position_embeddings}) of this GPT-2; generate fewer tokens or shorten "
            "the prompt."
        )
    zeros = jnp.zeros((batch, length, c.num_key_value_heads, c.head_dim), model.dtype)
    return [(zeros, zeros) for _ in range(c.num_hidden_layers)]


def cached_forward(
    model: Any,
    ids: Array,  # [B, T]: the tokens of slots start .. start + T - 1
    start: Array,  # scalar int32: cache slot of ids[:, 0]
    pad: Array,  # [B] int32: left-padding slots of each row
    cache: Cache,
    pixel_values: Array | None = None,
) -> tuple[Array, Cache]:
    """Logits [B, V] of the last of ``ids`` and the cache with their keys/values written.
    `pixel_values` [B, K, C, H, W]: the images of a vision-language model's prompt (each
    row's k-th image placeholder reads its slot k)."""
    slots = Slots.of(ids.shape[1], start, pad, cache[0][0].shape[1])
    return decode_with_slots(model, ids, slots, cache, pixel_values=pixel_values)
