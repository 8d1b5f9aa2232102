"""Batched and chunked prefill, per-token log-probs and the warm-up: several prompts go
through one compiled prefill call, a long prompt is written a chunk per step while other
requests keep decoding, greedy tokens stay those of `generate` throughout, the log-probs
equal the training code's for the same tokens, and after `warm_up` nothing compiles."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from engine_models import CompileLog, prompt, tiny_llama

from jaxtrain.models import generate
from jaxtrain.serving import Engine, SamplingParams
from jaxtrain.serving.prefill_plan import planned_cost, prefill_cap, prefill_costs, rows_that_fit
from jaxtrain.training.logps import model_token_logps


@pytest.fixture(scope="module")
def model():
    return tiny_llama(max_positions=96)


def recording(engine: Engine, shapes: list | None = None) -> list[tuple[int, int]]:
    """Each prefill call's (rows with real tokens, real tokens), as the engine makes it; and
    its padded [rows, tokens] in `shapes`."""
    calls: list[tuple[int, int]] = []
    original = engine.steps.prefill

    def prefill(*args):
        ids = np.asarray(args[2])
        calls.append((int((ids != 0).any(axis=1).sum()), int((ids != 0).sum())))
        if shapes is not None:
            shapes.append(ids.shape)
        return original(*args)

    engine.steps.prefill = prefill
    return calls


def test_several_prompts_are_prefilled_in_one_call_with_generates_tokens(model):
    engine = Engine(model, max_slots=8, page_size=4, max_length=48, eos_token_ids=[])
    calls = recording(engine)
    batch = [prompt(n, n) for n in (3, 9, 5, 12, 1, 7)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    got = engine.generate(batch, params)
    assert calls == [(6, sum(len(p) for p in batch))]  # every prompt in one call
    assert [c[0].token_ids for c in got] == [
        generate(model, p, max_new_tokens=6).tolist() for p in batch
    ]
    assert engine.pages.available == engine.pages.num_pages - 1


def test_short_prompts_are_cut_where_whole_ones_would_pad_more(model):
    """8 prompts of 20 tokens: whole, one call of 8 rows x 64 (the token bucket above 20),
    69% padding; cut at 16 tokens, two calls of 8 x 16, 38% padding. The plan's cost is the
    one of the calls the engine makes, and the tokens are generate's."""
    engine = Engine(model, max_slots=8, page_size=4, max_length=48, eos_token_ids=[])
    shapes: list[tuple[int, int]] = []
    calls = recording(engine, shapes)
    batch = [prompt(20, 60 + i) for i in range(8)]
    assert prefill_cap([20] * 8, 512, 8, engine.prefill_plan.costs) == 16
    got = engine.generate(batch, SamplingParams(max_tokens=5, temperature=0.0))
    assert calls == [(8, 8 * 16), (8, 8 * 4)] and shapes == [(8, 16), (8, 16)]
    costs = engine.prefill_plan.costs
    spent = sum(costs.call + r * (t + costs.row) for r, t in shapes)
    assert spent == planned_cost([20] * 8, 16, 512, 8, costs)
    assert spent < 0.9 * planned_cost([20] * 8, 512, 512, 8, costs)  # whole prompts: 8 x 64
    assert [c[0].token_ids for c in got] == [
        generate(model, p, max_new_tokens=5).tolist() for p in batch
    ]
    assert engine.pages.available == engine.pages.num_pages - 1


def test_the_cap_is_the_plan_that_pads_least_or_the_whole_prompt():
    cpu, accelerator = prefill_costs("cpu"), prefill_costs("gpu")
    # 32 chat prompts of 22 tokens past their cached prefix: 4 calls of 8 x 64 whole, 2 of
    # 32 x 16 cut; on an accelerator too (half the calls).
    assert (
        prefill_cap([22] * 32, 512, 32, cpu) == prefill_cap([22] * 32, 512, 32, accelerator) == 16
    )
    # A lone prompt of 70: 64 + 6 tokens in two calls (1 x 64, 1 x 16) on a CPU, not 1 x 256;
    # an accelerator's calls cost more than their padding: whole.
    assert prefill_cap([70], 512, 32, cpu) == 64
    assert prefill_cap([70], 512, 32, accelerator) == 512
    # Within MARGIN of the whole prompts' cost, whole: 8 x 40 (1 x 8 x 64, or 3 x 8 x 16).
    assert planned_cost([40] * 8, 16, 512, 32, cpu) < planned_cost([40] * 8, 512, 512, 32, cpu)
    assert prefill_cap([40] * 8, 512, 32, cpu) == 512
    # Long prompts stay whole (chunked by the budget as before); a budget of 16 has no choice.
    assert prefill_cap([2000, 900], 512, 32, cpu) == 512
    assert prefill_cap([22] * 32, 16, 32, cpu) == 16
    # rows_that_fit is the engine's rule: rows x token bucket within the budget.
    assert rows_that_fit([16] * 32, 512, 32) == 32 and rows_that_fit([20] * 9, 512, 32) == 8
    assert rows_that_fit([600], 512, 32) == 1


def test_a_long_prompt_is_written_in_chunks_while_another_request_decodes(model):
    engine = Engine(model, max_slots=4, page_size=4, max_length=96, prefill_tokens=16,
                    eos_token_ids=[])  # fmt: skip
    calls = recording(engine)
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    short, long = prompt(5, 1), prompt(70, 2)
    first = engine.submit(short, greedy)
    engine.step()  # the short prompt is prefilled and decoding
    second = engine.submit(long, SamplingParams(max_tokens=8, temperature=0.0), n=2)
    decoded, done = [], {}
    while not engine.idle:
        for completion in engine.step():
            done[completion.request_id, completion.index] = completion.token_ids
        decoded += [len(s.generated) for s in engine.active if s.request_id == first]
    # 70 tokens in chunks of at most 16: five calls after the short prompt's, and the short
    # request (its first token drawn at its prefill, its second decoded in the same step)
    # decoded one token in every one of those steps.
    assert calls[0] == (1, 5) and [tokens for _, tokens in calls[1:]] == [16, 16, 16, 16, 6]
    assert decoded[:5] == [3, 4, 5, 6, 7]
    assert done[first, 0] == generate(model, short, max_new_tokens=20).tolist()
    want = generate(model, long, max_new_tokens=8).tolist()
    assert done[second, 0] == done[second, 1] == want  # greedy: both samples alike
    assert engine.pages.available == engine.pages.num_pages - 1


def test_a_request_cancelled_while_prefilling_gives_its_pages_back(model):
    engine = Engine(model, max_slots=4, page_size=4, max_length=96, prefill_tokens=16)
    request = engine.submit(prompt(60, 3), SamplingParams(max_tokens=4), n=3)
    engine.step()
    assert engine.prefilling and engine.slots_in_use == 3
    engine.cancel(request)
    assert engine.idle and engine.slots_in_use == 0
    assert engine.pages.available == engine.pages.num_pages - 1


def test_logprobs_equal_the_training_codes_for_the_same_tokens(model):
    engine = Engine(model, max_slots=4, page_size=4, max_length=48, prefill_tokens=16)
    batch = [prompt(n, 20 + n) for n in (4, 19, 8)]
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True, logprobs=3)
    got = [group[0] for group in engine.generate(batch, params)]
    for p, completion in zip(batch, got):
        ids = jnp.asarray([p + completion.token_ids])
        trained, _ = model_token_logps(model, ids, ids)
        want = np.asarray(trained[0, len(p) - 1 :])
        np.testing.assert_allclose(completion.logprobs, want, rtol=1e-5, atol=1e-6)
        for token, logprob, top in zip(
            completion.token_ids, completion.logprobs, completion.top_logprobs
        ):
            assert len(top) == 3 and list(top.values()) == sorted(top.values(), reverse=True)
            assert logprob <= max(top.values()) + 1e-6
            if token in top:
                assert top[token] == pytest.approx(logprob, abs=1e-6)
    plain = engine.generate(batch[:1], SamplingParams(max_tokens=3, temperature=0.0))[0][0]
    assert plain.top_logprobs is None and len(plain.logprobs) == 3


def test_processed_logprobs_are_the_training_codes_at_the_request_temperature(model):
    """logprobs_mode="processed": log_softmax(logits / temperature), as GRPO scores a sampled
    token, for each request's own temperature (greedy rows keep the model's own)."""
    engine = Engine(model, max_slots=4, page_size=4, max_length=48, logprobs_mode="processed")
    batch = [prompt(n, 40 + n) for n in (5, 11)]
    for temperature in (0.7, 1.6, 0.0):
        params = SamplingParams(max_tokens=8, temperature=temperature, seed=2, ignore_eos=True)
        for p, group in zip(batch, engine.generate(batch, params)):
            ids = jnp.asarray([p + group[0].token_ids])
            trained, _ = model_token_logps(model, ids, ids, temperature=temperature or 1.0)
            want = np.asarray(trained[0, len(p) - 1 :])
            np.testing.assert_allclose(group[0].logprobs, want, rtol=1e-5, atol=1e-6)
    raw = Engine(model, max_slots=4, page_size=4, max_length=48)
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=2, ignore_eos=True)
    got = raw.generate(batch[:1], params)[0][0]
    processed = engine.generate(batch[:1], params)[0][0]
    assert got.token_ids == processed.token_ids  # the draw is the same; only the scores differ
    assert not np.allclose(got.logprobs, processed.logprobs, atol=1e-3)


def test_after_warm_up_nothing_compiles(model):
    engine = Engine(model, max_slots=4, page_size=4, max_length=64, prefill_tokens=32)
    shapes = engine.warm_up()
    assert shapes == len(engine.steps.compiles["prefill"]) + len(engine.steps.compiles["decode"])
    with CompileLog() as log:
        rng = np.random.default_rng(0)
        for round_ in range(4):
            lengths = rng.integers(1, 50, 5)
            settings = [
                SamplingParams(max_tokens=int(64 - lengths.max()), temperature=0.0),
                SamplingParams(max_tokens=5, temperature=0.9, top_p=0.8, seed=round_),
                SamplingParams(max_tokens=3, temperature=1.2, top_k=5, logprobs=2),
            ]
            for i, n in enumerate(lengths):
                engine.submit(prompt(int(n), round_ * 9 + i), settings[i % 3], n=1 + i % 2)
            while not engine.idle:
                engine.step()
    compiled = log.compiled
    assert not compiled, compiled
    assert engine.pages.available == engine.pages.num_pages - 1
