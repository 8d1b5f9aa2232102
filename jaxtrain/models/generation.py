"""Autoregressive sampling for any NNX causal LM called as ``model(input_ids) -> logits``.

No KV cache: each step runs the full forward over a fixed-length buffer (prompt +
max_new_tokens). Causal attention makes the not-yet-written tail irrelevant, and the
fixed shape means ONE compiled loop serves every prompt of the same total length.
Meant for demos, evaluation samples and tests, not for high-throughput serving.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@partial(jax.jit, static_argnames=("graphdef", "sample", "top_k"))
def _decode(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    buf: jax.Array,  # [B, L] int32: prompt, then zeros
    prompt_len: jax.Array,  # scalar int32 (traced: prompts of any length share a compile)
    key: jax.Array,
    temperature: jax.Array,
    eos_ids: jax.Array,  # [E] int32; -1 entries never match
    *,
    sample: bool,
    top_k: int | None,
) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(graphdef, state)
    batch, total = buf.shape

    def pick(logits: jax.Array, i: jax.Array) -> jax.Array:
        logits = logits.astype(jnp.float32)
        if not sample:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits / temperature
        if top_k is not None:
            kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        # fold_in(step): the draw at a position does not depend on batch history.
        return jax.random.categorical(jax.random.fold_in(key, i), logits).astype(jnp.int32)

    def cond(carry):
        i, _, done = carry
        return (i < total) & ~jnp.all(done)

    def body(carry):
        i, buf, done = carry
        logits = model(buf)  # [B, L, V]
        last = jax.lax.dynamic_index_in_dim(logits, i - 1, axis=1, keepdims=False)
        token = pick(last, i)
        # Finished rows keep emitting the (first) eos id so their tail is well defined.
        token = jnp.where(done, eos_ids[0], token)
        buf = jax.lax.dynamic_update_slice_in_dim(buf, token[:, None], i, axis=1)
        done = done | jnp.isin(token, eos_ids)
        return i + 1, buf, done

    done0 = jnp.zeros((batch,), dtype=bool)
    end, buf, _ = jax.lax.while_loop(cond, body, (prompt_len, buf, done0))
    return buf, end


def generate(
    model: nnx.Module,
    prompt_ids: np.ndarray | Sequence[int] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
) -> np.ndarray:
    """Generate continuations of ``prompt_ids``; returns only the new tokens (int32).

    - prompt_ids [P] -> [n] with n <= max_new_tokens; [B, P] (same-length prompts) ->
      [B, n] where n is the longest row; a row that ended earlier is filled with eos.
    - temperature 0 is greedy argmax; otherwise sample from softmax(logits / temperature),
      optionally restricted to the ``top_k`` most likely tokens. ``seed`` fixes the draws.
    - eos_token_id (int or list): generation stops once every row produced one; the eos
      token is kept, what would follow it is dropped. None never stops early.
    """
    prompt = np.asarray(prompt_ids)
    single = prompt.ndim == 1
    if single:
        prompt = prompt[None]
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(
            f"prompt_ids must be a non-empty [P] or [B, P] array of token ids, got shape "
            f"{np.asarray(prompt_ids).shape}; pad prompts to a common length or call per prompt."
        )
    if not np.issubdtype(prompt.dtype, np.integer):
        raise ValueError(f"prompt_ids must hold integers, got dtype {prompt.dtype}.")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}.")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or a positive int, got {top_k!r}.")
    if eos_token_id is None:
        eos = [-1]
    elif isinstance(eos_token_id, (int, np.integer)):
        eos = [int(eos_token_id)]
    else:
        eos = [int(e) for e in eos_token_id] or [-1]

    batch, plen = prompt.shape
    buf = np.zeros((batch, plen + max_new_tokens), dtype=np.int32)
    buf[:, :plen] = prompt
    graphdef, state = nnx.split(model)
    out, end = _decode(
        graphdef,
        state,
        jnp.asarray(buf),
        jnp.asarray(plen, jnp.int32),
        jax.random.key(seed),
        jnp.asarray(max(temperature, 1e-6), jnp.float32),
        jnp.asarray(eos, jnp.int32),
        sample=temperature > 0,
        top_k=top_k,
    )
    new = np.asarray(out)[:, plen : int(end)]
    if single:
        row = new[0]
        hits = np.flatnonzero(np.isin(row, eos))
        return row[: hits[0] + 1] if hits.size else row
    return new
