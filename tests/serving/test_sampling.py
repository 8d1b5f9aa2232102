"""The draw inside an engine step (serving/sampling.py) against references computed here in
float64 with numpy: where each uniform lands on the running sum of probability, which tokens
top-k and top-p keep (a sort's answer), and the log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.serving.sampling import SamplingParams, _filtered, sample_rows, sampling_arrays

ROWS = 16
VOCAB = 1000  # not a multiple of the draw's block of 256


def softmax64(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def kept_by_sorting(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The tokens top-k then top-p keep, by sorting in float64: the k largest logits (ties at
    the k-th kept), then the most likely whose mass before them is below top_p."""
    keep = np.isfinite(logits)
    if 0 < top_k < len(logits):
        keep &= logits >= np.sort(logits)[::-1][top_k - 1]
    if top_p < 1:
        probs = softmax64(np.where(keep, logits, -np.inf))
        order = np.argsort(-logits, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        keep &= logits >= logits[order][before < top_p].min()
    return keep


def uniform_of(seed: int, position: int) -> float:
    """The documented draw: one uniform from fold_in(key(seed), position)."""
    return float(jax.random.uniform(jax.random.fold_in(jax.random.key(seed), position)))


@pytest.fixture(scope="module")
def draw():
    return jax.jit(sample_rows)


def test_each_draw_lands_where_its_uniform_falls_on_the_running_sum(draw):
    rng = np.random.default_rng(0)
    logits = (rng.normal(size=(ROWS, VOCAB)) * 4).astype(np.float32)
    temperatures = rng.uniform(0.3, 2.0, ROWS).astype(np.float32)
    params = [
        SamplingParams(temperature=float(t), seed=100 + r) for r, t in enumerate(temperatures)
    ]
    seeds = [p.seed for p in params]
    arrays = sampling_arrays(params, seeds, ROWS)
    probs = np.stack([softmax64(logits[r] / temperatures[r]) for r in range(ROWS)])
    running = np.cumsum(probs, axis=1)
    # The log-prob is the model's own, before temperature (the default).
    model_logprobs = np.log(np.stack([softmax64(row) for row in logits]))
    tokens_seen = set()
    for position in range(0, 400, 8):
        out = draw(logits, *arrays, np.full(ROWS, position, np.int32))
        for r, token in enumerate(np.asarray(out.tokens)):
            u = uniform_of(seeds[r], position)
            low = running[r, token - 1] if token else 0.0
            # The token is the first whose running sum exceeds u (float32 rounding aside).
            assert low - 1e-6 <= u <= running[r, token] + 1e-6, (r, position, token, u)
            assert probs[r, token] > 0
            tokens_seen.add(int(token))
        want = model_logprobs[np.arange(ROWS), np.asarray(out.tokens)]
        np.testing.assert_allclose(np.asarray(out.logprobs), want, atol=1e-5)
    assert len(tokens_seen) > 100  # the draws are spread, not stuck on a few tokens


def test_a_filtered_draw_equals_the_draw_over_what_sorting_keeps(draw):
    rng = np.random.default_rng(1)
    logits = (rng.normal(size=(ROWS, VOCAB)) * 3).astype(np.float32)
    settings = [(k, p) for k in (0, 1, 7, 300) for p in (1.0, 0.95, 0.6, 1e-6)]
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, seed=r) for r, (k, p) in
              enumerate(settings)]  # fmt: skip
    arrays = sampling_arrays(params, [p.seed for p in params], ROWS)
    kept = [kept_by_sorting(logits[r], k, p) for r, (k, p) in enumerate(settings)]
    for position in range(0, 200, 10):
        tokens = np.asarray(draw(logits, *arrays, np.full(ROWS, position, np.int32)).tokens)
        for r, token in enumerate(tokens):
            assert kept[r][token], (settings[r], token)
            probs = softmax64(np.where(kept[r], logits[r], -np.inf))
            running, u = np.cumsum(probs), uniform_of(r, position)
            assert (running[token - 1] if token else 0.0) - 1e-6 <= u <= running[token] + 1e-6


def test_top_k_and_top_p_keep_exactly_what_sorting_keeps_on_a_full_vocabulary():
    """At a real vocabulary's size, rows beside each other with different settings. A row
    with top_p = 1 keeps every token even when another row filters (a float32 running sum
    over 49k probabilities reaches 1 before its end: the sort-based filter this replaced cut
    700 tokens of such a row's tail)."""
    rng = np.random.default_rng(2)
    vocab, rows = 49_152, 8
    logits = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    top_k = np.array([0, 0, 1, 40, vocab - 1, vocab + 5, 40, 0], np.int32)
    top_p = np.array([1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 0.5, 1e-6], np.float32)
    got = np.isfinite(np.asarray(jax.jit(_filtered)(logits, top_k, top_p)))
    for r in range(rows):
        want = kept_by_sorting(logits[r], int(top_k[r]), float(top_p[r]))
        assert (got[r] == want).all(), (r, got[r].sum(), want.sum())


def test_greedy_rows_beside_sampled_rows_take_the_argmax(draw):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(ROWS, VOCAB)).astype(np.float32)
    params = [SamplingParams(temperature=0.0 if r % 2 else 1.0, seed=r) for r in range(ROWS)]
    arrays = sampling_arrays(params, list(range(ROWS)), ROWS)
    drawn = draw(logits, *arrays, np.zeros(ROWS, np.int32)).tokens
    assert drawn.dtype == jnp.int32
    tokens = np.asarray(drawn)
    np.testing.assert_array_equal(tokens[1::2], logits[1::2].argmax(axis=1))
    assert (tokens[::2] != logits[::2].argmax(axis=1)).any()
