"""The engine's compiled steps: prefill (one prompt), decode (one token for every active row),
the first-token draw of a group and a page copy. Pure functions of arrays: the model's state
and the page pool are arguments (the pool donated), so live parameters change nothing that is
compiled, and each step compiles once per bucketed shape: rows, prompt tokens and page-table
width (`Steps.compiles` counts them)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.kv_cache import decode_with_slots
from jaxtrain.serving.paged import PagedSlots
from jaxtrain.serving.sampling import sample_rows

__all__ = ["Steps", "bucket"]

Array = jax.Array


def bucket(n: int, smallest: int, largest: int) -> int:
    """The smallest power-of-two multiple of `smallest` holding `n` (at most `largest`)."""
    size = smallest
    while size < n:
        size *= 2
    return min(size, largest)


class Steps:
    """The jitted steps of one model graph on pages of `page_size` tokens."""

    def __init__(self, graphdef: Any, page_size: int, pool_sharding: Any):
        # Every step returns the pool with the sharding it came in with: a pool whose
        # placement changed would compile each step a second time.
        self.graphdef, self.page_size, self.pool_sharding = graphdef, page_size, pool_sharding
        self.compiles: dict[str, set[tuple]] = {"prefill": set(), "decode": set(), "draw": set()}
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=1)
        self._decode = jax.jit(self._decode_fn, donate_argnums=1, static_argnums=9)
        self._draw = jax.jit(sample_rows, static_argnums=6)
        self._copy = jax.jit(
            lambda pool, source, target: self._placed(_copy_page(pool, source, target)),
            donate_argnums=0,
        )

    def _forward(self, state, pool, ids, start, table, pad=None):
        model = nnx.merge(self.graphdef, state)
        slots = PagedSlots.of(start, ids.shape[1], table, self.page_size, pad)
        logits, pool = decode_with_slots(model, ids, slots, pool)
        return logits, self._placed(pool)

    def _placed(self, pool: Any) -> Any:
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.pool_sharding), pool)

    def _prefill_fn(self, state, pool, ids, start, table, pad):
        logits, pool = self._forward(state, pool, ids, start, table, pad)
        return logits.astype(jnp.float32), pool

    def _decode_fn(self, state, pool, ids, start, table, temperature, top_k, top_p, seeds, draw):
        logits, pool = self._forward(state, pool, ids, start, table)
        tokens = sample_rows(logits, temperature, top_k, top_p, seeds, start + 1, draw)
        return tokens, pool

    # ------------------------------------------------------------- calls
    def prefill(self, state, pool, ids, start, table, pad) -> tuple[Array, Any]:
        """Logits [1, V] after a prompt [1, T] left-padded by `pad` [1] tokens, its first
        real token at position `start` [1]."""
        self.compiles["prefill"].add((ids.shape, table.shape))
        return self._prefill(state, pool, ids, start, table, pad)

    def decode(self, state, pool, ids, start, table, temperature, top_k, top_p, seeds, draw):
        """Each row's next token [B] from its last token [B, 1] at position `start` [B]."""
        self.compiles["decode"].add((ids.shape, table.shape, draw))
        return self._decode(state, pool, ids, start, table, temperature, top_k, top_p, seeds, draw)

    def draw(self, logits, temperature, top_k, top_p, seeds, positions, draw) -> Array:
        """First tokens [n] of n sequences sharing one prompt's logits [n, V]."""
        self.compiles["draw"].add((logits.shape, draw))
        return self._draw(logits, temperature, top_k, top_p, seeds, positions, draw)

    def copy_page(self, pool: Any, source: int, target: int) -> Any:
        """`pool` with page `target` a copy of page `source` in every layer."""
        return self._copy(pool, jnp.int32(source), jnp.int32(target))


def _copy_page(pool: Any, source: Array, target: Array) -> Any:
    return jax.tree.map(lambda x: x.at[target].set(x[source]), pool)
