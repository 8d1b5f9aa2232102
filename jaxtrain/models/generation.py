"""Autoregressive generation for NNX causal LMs: a KV cache for the Llama family (and its
mixture-of-experts models), Gemma 2 / 3 and GPT-2, and a cache-free fallback for any model
called as ``model(input_ids) -> logits``.

With the cache (``kv_cache.supports_kv_cache``): one prefill of the (left-padded) prompts,
then one decode step per new token inside a ``lax.while_loop``, all in one jitted program
whose cache has a fixed size (prompt + new tokens). Without it, every step reruns the full
forward over a fixed-length buffer; causal attention makes the not-yet-written tail
irrelevant. Both draw token ``i`` of the buffer with ``fold_in(key, i)``, so they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.kv_cache import cached_forward, empty_cache, supports_kv_cache

__all__ = ["generate", "sample_left_padded"]


def _pick(logits, i, key, temperature, top_p, *, sample: bool, top_k: int | None, nucleus: bool):
    """Next tokens [B] from logits [B, V]: argmax, or a draw after temperature/top-k/top-p
    (`nucleus`: top_p < 1; without it the vocabulary is not sorted at every step)."""
    logits = logits.astype(jnp.float32)
    if not sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    # top_k at or above the vocabulary keeps every token: the same as no top_k (jax.lax.top_k
    # refuses a k larger than the axis).
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if nucleus:
        # Keep the most likely tokens whose mass before them is < top_p (the first token is
        # always kept).
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.where(before < top_p, ordered, jnp.inf).min(axis=-1, keepdims=True)
        logits = jnp.where(logits < kept, -jnp.inf, logits)
    # fold_in(position): the draw at a position does not depend on batch history.
    return jax.random.categorical(jax.random.fold_in(key, i), logits).astype(jnp.int32)


@partial(jax.jit, static_argnames=("graphdef", "max_new", "sample", "top_k", "nucleus"))
def _generate_cached(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt: jax.Array,  # [B, P] int32, left-padded
    pad: jax.Array,  # [B] int32
    key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    eos_ids: jax.Array,  # [E] int32; -1 entries never match
    pixel_values: jax.Array | None = None,  # [B, K, C, H, W]: a vision prompt's images
    *,
    max_new: int,
    sample: bool,
    top_k: int | None,
    nucleus: bool,
) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(graphdef, state)
    batch, plen = prompt.shape
    pick = partial(_pick, key=key, temperature=temperature, top_p=top_p, sample=sample,
                   top_k=top_k, nucleus=nucleus)  # fmt: skip
    cache = empty_cache(model, batch, plen + max_new)
    logits, cache = cached_forward(model, prompt, jnp.int32(0), pad, cache, pixel_values)
    first = pick(logits, plen)
    out = jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, eos_ids)

    def cond(carry):
        i, _, _, done = carry
        return (i < max_new) & ~jnp.all(done)

    def body(carry):
        i, out, cache, done = carry
        prev = jax.lax.dynamic_index_in_dim(out, i - 1, axis=1)  # [B, 1]
        logits, cache = cached_forward(model, prev, plen + i - 1, pad, cache)
        token = pick(logits, plen + i)
        # Finished rows keep emitting the (first) eos id so their tail is well defined.
        token = jnp.where(done, eos_ids[0], token)
        out = jax.lax.dynamic_update_slice_in_dim(out, token[:, None], i, axis=1)
        return i + 1, out, cache, done | jnp.isin(token, eos_ids)

    end, out, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), out, cache, done))
    return out, end


@partial(jax.jit, static_argnames=("graphdef", "sample", "top_k", "nucleus"))
def _generate_uncached(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    buf: jax.Array,  # [B, L] int32: prompt, then zeros
    prompt_len: jax.Array,  # scalar int32 (traced: prompts of any length share a compile)
    key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    eos_ids: jax.Array,
    *,
    sample: bool,
    top_k: int | None,
    nucleus: bool,
) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(graphdef, state)
    batch, total = buf.shape
    pick = partial(_pick, key=key, temperature=temperature, top_p=top_p, sample=sample,
                   top_k=top_k, nucleus=nucleus)  # fmt: skip

    def cond(carry):
        i, _, done = carry
        return (i < total) & ~jnp.all(done)

    def body(carry):
        i, buf, done = carry
        logits = model(buf)  # [B, L, V]
        token = pick(jax.lax.dynamic_index_in_dim(logits, i - 1, axis=1, keepdims=False), i)
        token = jnp.where(done, eos_ids[0], token)
        buf = jax.lax.dynamic_update_slice_in_dim(buf, token[:, None], i, axis=1)
        return i + 1, buf, done | jnp.isin(token, eos_ids)

    done0 = jnp.zeros((batch,), dtype=bool)
    end, buf, _ = jax.lax.while_loop(cond, body, (prompt_len, buf, done0))
    return buf, end


def sample_left_padded(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    prompt: jax.Array,
    pad: jax.Array,
    key: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int | None,
    eos_token_ids: Sequence[int],
) -> tuple[jax.Array, jax.Array]:
    """Sampled tokens [B, max_new_tokens] (rows that ended repeat the first eos) and how many
    steps ran, from left-padded prompts [B, P] (`pad` [B]: each row's padding) on a KV-cache
    model split as (graphdef, state). Arrays stay on their devices: a caller with fixed
    shapes (GRPO) compiles it once, whatever the parameters' values."""
    eos = jnp.asarray(list(eos_token_ids) or [-1], jnp.int32)
    return _generate_cached(
        graphdef, state, prompt, pad, key,
        jnp.asarray(max(temperature, 1e-6), jnp.float32), jnp.asarray(top_p, jnp.float32), eos,
        max_new=max_new_tokens, sample=temperature > 0, top_k=top_k, nucleus=top_p < 1,
    )  # fmt: skip


def sampler_for(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int | None,
    eos_token_ids: Sequence[int] = (),
) -> Any:
    """`sample_left_padded` with its settings bound, jitted: (graphdef, state, prompt, pad,
    key) -> (tokens, steps). Lower it from abstract arrays to compile the sampler ahead of a
    run (`jaxtrain plan --task grpo`)."""

    def run(graphdef: nnx.GraphDef, state: nnx.State, prompt, pad, key):
        return sample_left_padded(
            graphdef, state, prompt, pad, key, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, eos_token_ids=eos_token_ids,
        )  # fmt: skip

    return jax.jit(run, static_argnums=0)


def _prompts(prompt_ids: Any) -> tuple[np.ndarray, np.ndarray, bool]:
    """(left-padded [B, P] int32, pad [B], single) from [P], [B, P] or a list of lists."""
    single = False
    if (
        isinstance(prompt_ids, (list, tuple))
        and prompt_ids
        and all(isinstance(p, (list, tuple, np.ndarray)) for p in prompt_ids)
    ):
        rows = [np.asarray(p) for p in prompt_ids]
    else:
        arr = np.asarray(prompt_ids)
        single = arr.ndim == 1
        if arr.ndim not in (1, 2):
            raise ValueError(
                f"prompt_ids must be a non-empty [P] or [B, P] array of token ids (or a list "
                f"of prompts), got shape {arr.shape}."
            )
        rows = list(arr[None] if single else arr)
    if not rows or any(r.ndim != 1 or r.size == 0 for r in rows):
        raise ValueError("prompt_ids must hold non-empty prompts of token ids; got an empty one.")
    if any(not np.issubdtype(r.dtype, np.integer) for r in rows):
        raise ValueError(f"prompt_ids must hold integers, got dtype {rows[0].dtype}.")
    plen = max(len(r) for r in rows)
    prompt = np.zeros((len(rows), plen), np.int32)
    pad = np.array([plen - len(r) for r in rows], np.int32)
    for b, r in enumerate(rows):
        prompt[b, pad[b] :] = r
    return prompt, pad, single


def generate(
    model: nnx.Module,
    prompt_ids: np.ndarray | Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    use_cache: bool = True,
    pixel_values: Any = None,
) -> np.ndarray:
    """Generate continuations of ``prompt_ids``; returns only the new tokens (int32).

    - prompt_ids [P] -> [n] with n <= max_new_tokens; [B, P] or a list of prompts of any
      lengths (left-padded internally) -> [B, n] where n is the longest row; a row that ended
      earlier is filled with eos.
    - temperature 0 is greedy argmax; otherwise sample from softmax(logits / temperature),
      restricted to the ``top_k`` most likely tokens (a ``top_k`` at or above the vocabulary
      keeps them all) and/or the smallest set whose probability reaches ``top_p``. ``seed``
      fixes the draws.
    - eos_token_id (int or list): generation stops once every row produced one; the eos
      token is kept, what would follow it is dropped. None never stops early.
    - use_cache: decode with a KV cache when the model supports it (the Llama family and its
      MoE, Gemma 2 / 3, GPT-2: ``kv_cache.supports_kv_cache``); other models, or False, rerun
      the whole prefix per token (same-length prompts only).
    - pixel_values [B, K, C, H, W]: a vision-language model's images, row b's k-th image
      placeholder reading slot k (data/vision.py's batches); the cached path only.
    """
    prompt, pad, single = _prompts(prompt_ids)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}.")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or a positive int, got {top_k!r}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}.")
    if eos_token_id is None:
        eos = [-1]
    elif isinstance(eos_token_id, (int, np.integer)):
        eos = [int(eos_token_id)]
    else:
        eos = [int(e) for e in eos_token_id] or [-1]

    batch, plen = prompt.shape
    graphdef, state = nnx.split(model)
    common = (
        jax.random.key(seed),
        jnp.asarray(max(temperature, 1e-6), jnp.float32),
        jnp.asarray(top_p, jnp.float32),
        jnp.asarray(eos, jnp.int32),
    )
    flags = dict(sample=temperature > 0, top_k=top_k, nucleus=top_p < 1)
    if pixel_values is not None:
        pixel_values = jnp.asarray(pixel_values)
        if not (use_cache and supports_kv_cache(model)) or pixel_values.shape[0] != batch:
            raise ValueError(
                f"pixel_values must be [{batch} prompts, images, C, H, W] for a KV-cache "
                f"vision-language model; got {tuple(pixel_values.shape)} for "
                f"{type(model).__name__} (use_cache={use_cache})."
            )
    if use_cache and supports_kv_cache(model):
        out, end = _generate_cached(graphdef, state, jnp.asarray(prompt), jnp.asarray(pad),
                                    *common, pixel_values, max_new=max_new_tokens,
                                    **flags)  # fmt: skip
        new = np.asarray(out)[:, : int(end)]
    else:
        if pad.any():
            raise ValueError(
                "prompts of different lengths need a KV-cache model (the Llama family and its "
                "MoE, Gemma, GPT-2); pad them to one length or generate per prompt."
            )
        buf = np.zeros((batch, plen + max_new_tokens), dtype=np.int32)
        buf[:, :plen] = prompt
        out, end = _generate_uncached(graphdef, state, jnp.asarray(buf),
                                      jnp.asarray(plen, jnp.int32), *common, **flags)  # fmt: skip
        new = np.asarray(out)[:, plen : int(end)]
    if single:
        row = new[0]
        hits = np.flatnonzero(np.isin(row, eos))
        return row[: hits[0] + 1] if hits.size else row
    return new
