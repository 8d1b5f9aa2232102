"""Speculative decoding by n-gram prompt lookup: greedy and seeded sampled outputs (and their
log-probs) are token for token those of the engine without it, and of `generate`, while a
step keeps several drafted tokens when the text repeats itself; with a pool small enough to
preempt too, every page comes back."""

from __future__ import annotations

import numpy as np
import pytest
from engine_models import VOCAB, tiny_llama

from jaxtrain.models import generate
from jaxtrain.serving import Engine, SamplingParams
from jaxtrain.serving.speculation import ngram_draft


@pytest.fixture(scope="module")
def model():
    return tiny_llama(max_positions=128, initializer_range=0.1)  # it loops: drafts are kept


def batch() -> list[list[int]]:
    rng = np.random.default_rng(4)
    phrase = rng.integers(3, VOCAB, 7).tolist()
    return [phrase * 4, rng.integers(3, VOCAB, 9).tolist(), (phrase[:3] + [5]) * 3]


def run(engine: Engine, params: SamplingParams) -> tuple[list, int]:
    ids = [engine.submit(p, params, n=2) for p in batch()]
    out, steps = {}, 0
    while not engine.idle:
        steps += 1
        for c in engine.step():
            out[ids.index(c.request_id), c.index] = (c.token_ids, c.logprobs)
    return [out[key] for key in sorted(out)], steps


def test_the_draft_is_what_followed_the_latest_earlier_occurrence():
    tokens = np.array([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    np.testing.assert_array_equal(ngram_draft(tokens, 3), [4, 9, 2])  # "1 2 3", the longest
    np.testing.assert_array_equal(ngram_draft(tokens, 3, longest=2), [5, 6, 1])  # "2 3": at 5
    assert len(ngram_draft(np.array([1, 2, 3, 4]), 3)) == 0


@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_speculation_changes_no_token_and_saves_steps(model, temperature):
    params = SamplingParams(max_tokens=40, temperature=temperature, top_k=20, seed=7)
    kwargs = dict(max_slots=8, page_size=4, max_length=128, eos_token_ids=[])
    plain, plain_steps = run(Engine(model, **kwargs), params)
    engine = Engine(model, speculative_tokens=4, **kwargs)
    fast, fast_steps = run(engine, params)
    assert [tokens for tokens, _ in fast] == [tokens for tokens, _ in plain]
    for (_, a), (_, b) in zip(fast, plain):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert engine.accepted > 0 and fast_steps <= plain_steps
    assert engine.pages.available == engine.pages.num_pages - 1
    if temperature == 0:  # every sequence loops: each finishes in fewer steps
        assert fast_steps < plain_steps
        want = [generate(model, p, max_new_tokens=40).tolist() for p in batch()]
        assert [tokens for tokens, _ in fast] == [w for w in want for _ in range(2)]


def test_speculation_with_preemption_gives_the_same_tokens(model):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    kwargs = dict(max_slots=8, page_size=4, max_length=128, eos_token_ids=[])
    plain, _ = run(Engine(model, **kwargs), params)
    small = Engine(model, speculative_tokens=3, num_pages=40, **kwargs)
    got, _ = run(small, params)
    assert [t for t, _ in got] == [t for t, _ in plain]
    assert small.preemptions > 0 and small.accepted > 0
    assert small.pages.available == small.pages.num_pages - 1
