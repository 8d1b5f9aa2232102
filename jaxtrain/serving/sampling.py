"""Per-request sampling settings and the draw of each row's next token, inside the step.

Every row of a decode step carries its own settings (temperature, top-k, top-p, seed), as
arrays, so requests with different settings share one compiled step. A row's draw at
position p is one uniform number from `fold_in(key(seed), p)`, placed on the running sum of
the row's probabilities: it depends on the request alone, never on which other requests
share the batch, so a seeded request is reproducible.

Which work a step does is decided inside it (`lax.cond` on the rows' settings), not by a
static flag: a step of greedy rows is an argmax, top-k and top-p thresholds are searched only
when some row filters by them, and the top log-probs are ranked only when some row asks.
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
import numbers
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_TOP_LOGPROBS", "Drawn", "SamplingParams", "sample_rows", "sampling_arrays"]

Array = jax.Array
# OpenAI's limit on top_logprobs: a step ranks this many alternatives when any row asks.
MAX_TOP_LOGPROBS = 20
# Vocabulary entries per block of the two-level draw (`_inverse_cdf`).
BLOCK = 256
SIGN_BIT = 0x80000000  # of a float32's bits


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
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))  # numpy's integers too (GRPO's)


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
    """`scaled` logits [B, V] with what each row's top-k and top-p exclude set to -inf.

    Each cut is a threshold found by bisection over the order of float32 values (32 passes
    of a count or a sum over the vocabulary), not by sorting it: XLA:CPU sorted 32 x 49k
    logits in 330 ms, a step's whole forward is 120."""
    vocab = scaled.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    # The k-th largest logit: the largest t with at least k logits >= t.
    kth = jax.lax.cond(
        jnp.any(k < vocab),
        lambda s: _bisect(lambda t: jnp.sum(s >= t[:, None], axis=-1) < k, len(s)),
        lambda s: jnp.full(len(s), -jnp.inf),
        scaled,
    )
    scaled = jnp.where(scaled < kth[:, None], -jnp.inf, scaled)

    # Nucleus: keep the most likely tokens whose mass before them is < top_p (the first
    # token is always kept): the smallest logit t whose tokens above hold less than top_p.
    def nucleus(s: Array) -> Array:
        probs = jax.nn.softmax(s, axis=-1)
        above = lambda t: jnp.sum(jnp.where(s > t[:, None], probs, 0), axis=-1)  # noqa: E731
        cut = _bisect(lambda t: above(t) < top_p, len(s), smallest=True)
        return jnp.where(top_p < 1, cut, -jnp.inf)

    kept = jax.lax.cond(jnp.any(top_p < 1), nucleus, lambda s: jnp.full(len(s), -jnp.inf), scaled)
    return jnp.where(scaled < kept[:, None], -jnp.inf, scaled)


def _bisect(passes: Callable[[Array], Array], rows: int, smallest: bool = False) -> Array:
    """[rows] float32 thresholds t where `passes(t)` [rows] bool turns from False to True as t
    grows (monotone): the largest t still False, or with `smallest` the smallest t True. Exact:
    float32 values are bisected as the unsigned integers that order them, 32 halvings."""
    sign = jnp.uint32(SIGN_BIT)

    def value(order: Array) -> Array:  # the float whose order is `order`
        bits = jnp.where(order >= sign, order ^ sign, ~order)
        return jax.lax.bitcast_convert_type(bits, jnp.float32)

    def halve(_: int, bounds: tuple[Array, Array]) -> tuple[Array, Array]:
        low, high = bounds  # passes(value(low)) False or low the bottom; passes(value(high)) True
        mid = low + (high - low) // 2 + (0 if smallest else 1)
        ok = passes(value(mid))
        if smallest:
            return jnp.where(ok, low, mid + 1), jnp.where(ok, mid, high)
        return jnp.where(ok, low, mid), jnp.where(ok, mid - 1, high)

    bottom, top = _order(-jnp.inf), _order(jnp.inf)
    start = (jnp.full(rows, bottom, jnp.uint32), jnp.full(rows, top, jnp.uint32))
    low, high = jax.lax.fori_loop(0, 32, halve, start)
    return value(high if smallest else low)


def _order(x: float) -> int:
    """The unsigned integer of float32 `x` in the order of float values (sign bit flipped for
    positives, every bit for negatives)."""
    bits = int(np.float32(x).view(np.uint32))
    return bits ^ SIGN_BIT if bits < SIGN_BIT else ~bits & 0xFFFFFFFF


def _inverse_cdf(scaled: Array, uniform: Array) -> Array:
    """Each row's token at `uniform` [B] in [0, 1) of softmax(`scaled`) [B, V]: the first
    token whose running sum of probability exceeds uniform x the row's total, so a token of
    zero probability (filtered out) is never drawn.

    In two levels: the running sum over blocks of BLOCK tokens, then over the one block the
    draw falls in: XLA:CPU's running sum over a whole 49k vocabulary took 10 ms at 32 rows,
    this 2 ms."""
    b, v = scaled.shape
    blocks = -(-v // BLOCK)
    weights = jnp.exp(scaled - scaled.max(axis=-1, keepdims=True))  # unnormalised
    weights = jnp.pad(weights, ((0, 0), (0, blocks * BLOCK - v))).reshape(b, blocks, BLOCK)
    mass = weights.sum(axis=-1)  # [B, blocks]
    running = jnp.cumsum(mass, axis=-1)
    target = uniform * running[:, -1]
    # Rounding can put the target at or past the last sum: then the last block (token) with
    # any probability, never one without.
    block = jnp.minimum(jnp.sum(running <= target[:, None], axis=-1), _last_positive(mass))
    inside = jnp.take_along_axis(weights, block[:, None, None], axis=1)[:, 0]  # [B, BLOCK]
    before = jnp.take_along_axis(running - mass, block[:, None], axis=1)
    offset = jnp.sum(jnp.cumsum(inside, axis=-1) <= target[:, None] - before, axis=-1)
    return block * BLOCK + jnp.minimum(offset, _last_positive(inside))


def _last_positive(x: Array) -> Array:
    """[B]: the last index of each row of `x` [B, N] holding a positive value."""
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(x > 0, index, 0), axis=-1)


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
    greedy_rows = temperature <= 0
    # argmax over the vocabulary costs what the whole draw does on CPU: only when a row wants it
    greedy = jax.lax.cond(
        jnp.any(greedy_rows),
        lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32),
        lambda x: jnp.zeros(x.shape[0], jnp.int32),
        logits,
    )

    def sampled(_: None) -> Array:
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        filters = jnp.any((top_k > 0) & (temperature > 0)) | jnp.any(
            (top_p < 1) & (temperature > 0)
        )
        scaled = jax.lax.cond(filters, lambda s: _filtered(s, top_k, top_p), lambda s: s, scaled)
        # Inverse-CDF sampling: one uniform per row (a Gumbel draw, jax.random.categorical,
        # needs a random number per vocabulary entry: 6x the time on CPU at 32 x 49k).
        keys = jax.vmap(lambda seed, p: jax.random.fold_in(jax.random.key(seed), p))
        uniform = jax.vmap(jax.random.uniform)(keys(seeds, positions))
        return jnp.where(greedy_rows, greedy, _inverse_cdf(scaled, uniform))

    tokens = jax.lax.cond(jnp.any(~greedy_rows), sampled, lambda _: greedy, None)
    if processed:  # a greedy row (temperature 0) keeps the model's own distribution
        logits = logits / jnp.where(greedy_rows, 1.0, temperature)[:, None]
    # The chosen token's log-prob from the row's log-normaliser alone: the [B, V] log_softmax
    # is built only when some row wants its alternatives ranked. Same arithmetic as
    # jax.nn.log_softmax: (x - max) - log(sum(exp(x - max))).
    shifted = logits - jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    normaliser = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    chosen = jnp.take_along_axis(shifted, tokens[:, None], axis=-1)[:, 0] - normaliser
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])

    def ranked(_: None) -> tuple[Array, Array]:
        values, ids = jax.lax.top_k(shifted - normaliser[:, None], k)
        return ids.astype(jnp.int32), values

    def unranked(_: None) -> tuple[Array, Array]:
        return jnp.zeros((logits.shape[0], k), jnp.int32), jnp.zeros((logits.shape[0], k))

    top_ids, top_values = jax.lax.cond(jnp.any(top_logprobs > 0), ranked, unranked, None)
    return Drawn(tokens, chosen, top_ids, top_values)
