"""Per-request sampling settings and the draw of each row's next token, inside the step.

Every row of a decode step carries its own settings (temperature, top-k, top-p, seed), as
arrays, so requests with different settings share one compiled step. A row's draw at
position p uses `fold_in(key(seed), p)`: it depends on the request alone, never on which
other requests share the batch, so a seeded request is reproducible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = ["Draw", "SamplingParams", "sample_rows"]

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    temperature 0 is greedy (argmax); otherwise softmax(logits / temperature) restricted to
    the `top_k` most likely tokens (0: all) and the smallest set whose probability reaches
    `top_p`. Decoding stops after `max_tokens` new tokens, at an end-of-sequence id (the
    model's unless `ignore_eos`, and `stop_token_ids`; the stop token is kept), or once the
    text contains one of `stop` (the text is cut before it). `seed` fixes the draws."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))


@dataclasses.dataclass(frozen=True)
class Draw:
    """What a step's rows need, as static flags (a compiled step per combination): any row
    sampling at all, any with top-k, any with top-p < 1. A step of greedy rows only is an
    argmax; sorting the vocabulary of every row is paid only when a row filters."""

    sample: bool = True
    top_k: bool = True
    top_p: bool = True

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> Draw:
        sampled = [p for p in params if p.temperature > 0]
        return cls(
            sample=bool(sampled),
            top_k=any(p.top_k > 0 for p in sampled),
            top_p=any(p.top_p < 1 for p in sampled),
        )


def sample_rows(
    logits: Array,  # [B, V]
    temperature: Array,  # [B] float32; 0 = greedy
    top_k: Array,  # [B] int32; 0 = off
    top_p: Array,  # [B] float32
    seeds: Array,  # [B] uint32
    positions: Array,  # [B] int32: the position of the token being drawn
    draw: Draw = Draw(),
) -> Array:
    """Each row's next token [B] under its own settings (see the module docstring); `draw`
    says which filters any row uses (the others' settings leave them unused anyway)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not draw.sample:
        return greedy
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    if draw.top_k or draw.top_p:
        ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    if draw.top_k:
        vocab = logits.shape[-1]
        k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
        ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    if draw.top_p:
        # Nucleus: keep the most likely tokens whose mass before them is < top_p (the first
        # token is always kept); top_p = 1 keeps everything.
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.where(before < top_p[:, None], ordered, jnp.inf).min(axis=-1, keepdims=True)
        scaled = jnp.where(scaled < kept, -jnp.inf, scaled)

    def draw(row_logits: Array, seed: Array, position: Array) -> Array:
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.categorical(key, row_logits).astype(jnp.int32)

    drawn = jax.vmap(draw)(scaled, seeds, positions)
    return jnp.where(temperature > 0, drawn, greedy)
