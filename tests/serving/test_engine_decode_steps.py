"""Several decode steps in one call (`Engine(decode_steps=k)`, serving/decoding.py): greedy and
seeded sampled outputs, their log-probs and their finish reasons are token for token those of
single steps, and of `generate`, with sequences ending mid-call (on an end id and at
max_tokens), a request arriving while others decode, a pool small enough to fall back to
single steps, and warm-up compiling the call's shapes; every page comes back."""

from __future__ import annotations

import numpy as np
import pytest
from engine_models import VOCAB, tiny_llama

from jaxtrain.errors import ArgumentError
from jaxtrain.models import generate
from jaxtrain.serving import Engine, SamplingParams

PROMPTS = [np.random.default_rng(n).integers(3, VOCAB, n).tolist() for n in (3, 11, 6, 17)]
KWARGS = dict(max_slots=8, page_size=4, max_length=48)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def run(engine: Engine, params: list[SamplingParams], late: SamplingParams | None = None):
    """Every prompt's two samples (token ids, log-probs, finish reason), and the engine's
    steps; `late`: a fifth request submitted after three steps, while the others decode."""
    ids = [engine.submit(p, q, n=2) for p, q in zip(PROMPTS, params)]
    out, steps = {}, 0
    while not engine.idle:
        steps += 1
        if steps == 4 and late is not None:
            ids.append(engine.submit(PROMPTS[0][::-1], late, n=1))
        for c in engine.step():
            out[ids.index(c.request_id), c.index] = (c.token_ids, c.logprobs, c.finish_reason)
    return [out[key] for key in sorted(out)], steps


def params(temperature: float) -> list[SamplingParams]:
    # Different lengths end sequences at every offset of a 4-step call.
    return [SamplingParams(max_tokens=m, temperature=temperature, seed=s, logprobs=2)
            for s, m in enumerate((13, 7, 22, 10))]  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_four_steps_a_call_give_the_tokens_of_single_steps(model, temperature):
    late = SamplingParams(max_tokens=9, temperature=temperature, seed=9)
    single, single_steps = run(Engine(model, **KWARGS), params(temperature), late)
    engine = Engine(model, decode_steps=4, **KWARGS)
    many, many_steps = run(engine, params(temperature), late)
    assert len(many) == len(single) == 9
    for (tokens, logprobs, reason), (tokens_1, logprobs_1, reason_1) in zip(many, single):
        assert tokens == tokens_1 and reason == reason_1
        np.testing.assert_allclose(logprobs, logprobs_1, rtol=1e-5, atol=1e-5)
    assert many_steps < single_steps / 2  # the calls did take several tokens
    assert engine.pages.available == engine.pages.num_pages - 1
    if temperature == 0.0:
        for (tokens, _, _), p in zip(many[::2], PROMPTS):
            assert tokens == generate(model, p, max_new_tokens=len(tokens)).tolist()


def test_an_end_id_mid_call_ends_the_sequence_there(model):
    """The greedy tokens of single steps, with their third token as the end id: the engine
    of 4-step calls ends every sequence at it, as single steps do."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    reference = Engine(model, eos_token_ids=[], **KWARGS).generate(PROMPTS, greedy)
    for prompt, [completion] in zip(PROMPTS, reference):
        eos = completion.token_ids[2]
        engine = Engine(model, eos_token_ids=[eos], decode_steps=4, **KWARGS)
        [[ended]] = engine.generate([prompt], greedy)
        cut = completion.token_ids.index(eos) + 1
        assert ended.token_ids == completion.token_ids[:cut] and ended.finish_reason == "stop"
        assert engine.pages.available == engine.pages.num_pages - 1


def test_a_short_pool_falls_back_to_single_steps_and_preempts(model):
    """Pages for 4 tokens of every sequence are not there: the engine decodes one token at a
    time (preempting as it must) and the outputs do not change."""
    greedy = params(0.0)
    single, _ = run(Engine(model, num_pages=14, **KWARGS), greedy)
    engine = Engine(model, num_pages=14, decode_steps=4, **KWARGS)
    many, _ = run(engine, greedy)
    assert [t for t, _, _ in many] == [t for t, _, _ in single]
    assert engine.preemptions > 0 and engine.pages.available == engine.pages.num_pages - 1


def test_warm_up_compiles_the_calls_of_several_steps(model):
    engine = Engine(model, decode_steps=4, **KWARGS)
    engine.warm_up(max_prompt_tokens=17)
    compiled = {kind: set(shapes) for kind, shapes in engine.steps.compiles.items()}
    assert compiled["decode_many"]
    run(engine, params(1.0))
    assert {kind: set(shapes) for kind, shapes in engine.steps.compiles.items()} == compiled


def test_decode_steps_is_checked(model):
    with pytest.raises(ArgumentError, match="decode_steps must be an integer >= 1"):
        Engine(model, decode_steps=0, **KWARGS)
    with pytest.raises(ArgumentError, match="choose one"):
        Engine(model, decode_steps=4, speculative_tokens=2, **KWARGS)
