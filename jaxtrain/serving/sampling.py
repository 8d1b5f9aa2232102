"""Per-request sampling settings and the draw of each row's next token, inside the step.

Every row of a decode step carries its own settings (temperature, top-k, top-p, seed), as
arrays, so requests with different settings share one compiled step. A row's draw at
position p is one uniform number from `fold_in(key(seed), p)`, placed on the running sum of
the row's probabilities: it depends on the request alone, never on which other requests
share the batch, so a seeded request is reproducible.

Which work a step does is decided inside it (`lax.cond` on the rows' settings), not by a
static flag: a step of greedy rows is an argmax, the vocabulary is sorted only when some row
filters by top-k or top-p, and the top log-probs are ranked only when some row asks for them.
One compiled step per shape serves every mix of settings, so a server compiles its buckets
once, at start-up, whatever its clients send.

Log-probs are the model's own distribution, log_softmax(logits) in float32, before
temperature, top-k and top-p (what the training code scores a token with at temperature 1,
and what OpenAI's and vLLM's APIs return by default). With `processed` they are after the
row's temperature, before top-k and top-p: log_softmax(logits / temperature), the
distribution an RL trainer scores a sampled token with (vLLM's "processed_logprobs", which
TRL's importance-sampling correction reads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_TOP_LOGPROBS", "Drawn", "SamplingParams", "sample_rows", "sampling_arrays"]

Array = jax.Array
# OpenAI's limit on top_logprobs: a step ranks this many alternatives when any row asks.
MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    temperature 0 is greedy (argmax); otherwise softmax(logits / temperature) restricted to
    the `top_k` most likely tokens (0: all) and the smallest set whose probability reaches
    `top_p`. Decoding stops after `max_tokens` new tokens, at an end-of-sequence id (the
    model's unless `ignore_eos`, and `stop_token_ids`; the stop token is kept), or once the
    text contains one of `stop` (the text is cut before it). `seed` fixes the draws.
    Every completion carries each sampled token's log-prob; `logprobs` = k > 0 adds the k
    most likely tokens' at each position (at most MAX_TOP_LOGPROBS)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {self.logprobs!r}"
            )
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drawn:
    """A step's draw for each of its B rows: the token [B], its log-prob [B], and the
    MAX_TOP_LOGPROBS most likely tokens [B, K] with their log-probs [B, K] (zeros when no
    row asked for them)."""

    tokens: Array
    logprobs: Array
    top_ids: Array
    top_logprobs: Array

    def row(self, r: int) -> Drawn:
        """Row r of a draw whose arrays have a step axis after the row's (a call of several
        steps or a verification): its tokens in order."""
        return Drawn(self.tokens[r], self.logprobs[r], self.top_ids[r], self.top_logprobs[r])


def sampling_arrays(
    params: Sequence[SamplingParams], seeds: Sequence[int], rows: int
) -> list[np.ndarray]:
    """[rows] arrays of temperature, top_k, top_p, seed and the top log-probs wanted (idle
    rows greedy, asking for nothing): host arrays, which a jitted step places with its call
    (steps.py: no device_put of each, and no compile of a copy as jnp.asarray would)."""
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    seed = np.zeros(rows, np.uint32)
    top_logprobs = np.zeros(rows, np.int32)
    for r, (p, s) in enumerate(zip(params, seeds)):
        temperature[r], top_k[r], top_p[r], seed[r] = p.temperature, p.top_k, p.top_p, s
        top_logprobs[r] = p.logprobs
    return [temperature, top_k, top_p, seed, top_logprobs]


def _filtered(scaled: Array, top_k: Array, top_p: Array) -> Array:
    """`scaled` logits [B, V] with what each row's top-k and top-p exclude set to -inf."""
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = scaled.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    ordered = jnp.where(ordered < kth, -jnp.inf, ordered)
    # Nucleus: keep the most likely tokens whose mass before them is < top_p (the first
    # token is always kept); top_p = 1 keeps everything.
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.where(before < top_p[:, None], ordered, jnp.inf).min(axis=-1, keepdims=True)
    return jnp.where(scaled < kept, -jnp.inf, scaled)


def sample_rows(
    logits: Array,  # [B, V]
    temperature: Array,  # [B] float32; 0 = greedy
    top_k: Array,  # [B] int32; 0 = off
    top_p: Array,  # [B] float32
    seeds: Array,  # [B] uint32
    top_logprobs: Array,  # [B] int32: alternatives each row wants ranked (0: none)
    positions: Array,  # [B] int32: the position of the token being drawn
    processed: bool = False,  # log-probs after the temperature (module docstring)
) -> Drawn:
    """Each row's next token under its own settings and its log-probs (module docstring)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_: None) -> Array:
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        filters = jnp.any((top_k > 0) & (temperature > 0)) | jnp.any(
            (top_p < 1) & (temperature > 0)
        )
        scaled = jax.lax.cond(filters, lambda s: _filtered(s, top_k, top_p), lambda s: s, scaled)
        # Inverse-CDF sampling: one uniform per row against the running sum of the row's
        # probabilities (a token excluded by a filter has an empty interval). A Gumbel draw
        # (jax.random.categorical) needs a random number per vocabulary entry: 6x the time
        # on CPU at 32 rows x 49k tokens.
        keys = jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.key(seed), p))
        uniform = jax.vmap(jax.random.uniform)(keys(seeds, positions))
        cdf = jnp.cumsum(jax.nn.softmax(scaled, axis=-1), axis=-1)
        drawn = jnp.sum(cdf < (uniform * cdf[:, -1])[:, None], axis=-1).astype(jnp.int32)
        return jnp.where(temperature > 0, drawn, greedy)

    tokens = jax.lax.cond(jnp.any(temperature > 0), sampled, lambda _: greedy, None)
    if processed:  # a greedy row (temperature 0) keeps the model's own distribution
        logits = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]

    def ranked(_: None) -> tuple[Array, Array]:
        values, ids = jax.lax.top_k(logp, min(MAX_TOP_LOGPROBS, logp.shape[-1]))
        return ids.astype(jnp.int32), values

    def unranked(_: None) -> tuple[Array, Array]:
        k = min(MAX_TOP_LOGPROBS, logp.shape[-1])
        return jnp.zeros((logp.shape[0], k), jnp.int32), jnp.zeros((logp.shape[0], k))

    top_ids, top_values = jax.lax.cond(jnp.any(top_logprobs > 0), ranked, unranked, None)
    return Drawn(tokens, chosen, top_ids, top_values)
