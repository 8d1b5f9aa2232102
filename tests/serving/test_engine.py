"""The engine's mechanics: continuous batching, pages freed and shared, prefix reuse, stop
conditions, seeded sampling independent of the batch, and a fixed set of compiles."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from engine_models import VOCAB, CompileLog, prompt, tiny_llama
from flax import nnx

from jaxtrain.errors import ArgumentError
from jaxtrain.models import GPT2Config, GPT2LMHeadModel, generate
from jaxtrain.models.moe import MoeConfig, MoeForCausalLM
from jaxtrain.serving import Engine, SamplingParams
from jaxtrain.serving.paged import prefix_keys


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_requests_join_while_others_decode_and_free_their_pages(model):
    engine = Engine(model, max_slots=2, page_size=4, max_length=48, eos_token_ids=[])
    short = SamplingParams(max_tokens=2, temperature=0.0)
    long = SamplingParams(max_tokens=9, temperature=0.0)
    a = engine.submit(prompt(5, 1), long)
    b = engine.submit(prompt(7, 2), short)
    c = engine.submit(prompt(3, 3), long)  # waits for b's slot
    seen = []
    while not engine.idle:
        finished = engine.step()
        seen += [(f.request_id, len(engine.active)) for f in finished]
        assert len(engine.active) <= 2
    assert [r for r, _ in seen] == [b, a, c]
    assert engine.pages.available == engine.pages.num_pages - 1  # every page back
    # c started as soon as b's slot was free, while a still decoded: the same tokens as alone.
    alone = Engine(model, max_slots=1, page_size=4, max_length=48, eos_token_ids=[])
    want = generate(model, prompt(3, 3), max_new_tokens=9).tolist()
    assert alone.generate([prompt(3, 3)], long)[0][0].token_ids == want


def test_a_group_shares_its_prompt_pages_and_a_later_request_reuses_the_prefix(model):
    engine = Engine(model, max_slots=4, page_size=4, max_length=40, eos_token_ids=[])
    system = prompt(13, 5)  # three full pages and one token
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=4)
    prefills = []
    original = engine.steps.prefill
    engine.steps.prefill = lambda *a: prefills.append(int((a[2] != 0).sum())) or original(*a)
    engine.submit(system, params, n=4)
    engine.step()
    # One prefill of 13 tokens; 4 samples x 4 pages (16 tokens) would be 16 pages without
    # sharing: the 3 full prompt pages are shared, each sample has 1 page of its own.
    assert prefills == [13]
    used = engine.pages.num_pages - 1 - len(engine.pages.free)
    assert used == 3 + 1 + 3 * 1
    while not engine.idle:
        engine.step()
    engine.generate([system + prompt(2, 6)], SamplingParams(max_tokens=2, temperature=0.0))
    assert prefills == [13, 15 - 12]  # the cached 3 pages (12 tokens) are not prefilled again


def test_a_request_continuing_a_finished_sequence_prefills_only_what_is_new(model):
    """A tool's answer appended to a completion (a chat's next turn): the finished
    sequence's written pages are cached, and the continuation decodes as from scratch."""
    engine = Engine(model, max_slots=2, page_size=4, max_length=48, eos_token_ids=[])
    prefills = []
    original = engine.steps.prefill
    engine.steps.prefill = lambda *a: prefills.append(int((a[2] != 0).sum())) or original(*a)
    first = prompt(6, 7)
    greedy = SamplingParams(max_tokens=11, temperature=0.0)
    [done] = engine.generate([first], greedy)[0]
    answer = prompt(5, 8)  # what a tool said
    rest = first + done.token_ids + answer  # 22 tokens: 16 written before (4 full pages)
    [turn] = engine.generate([rest], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert prefills == [6, len(rest) - 16]
    fresh = Engine(model, max_slots=2, page_size=4, max_length=48, eos_token_ids=[])
    again = fresh.generate([rest], SamplingParams(max_tokens=6, temperature=0.0))[0][0]
    assert turn.token_ids == again.token_ids
    assert engine.pages.available == engine.pages.num_pages - 1  # cached pages are evictable


def test_stop_ids_stop_strings_and_max_tokens(model):
    class Digits:  # a tokenizer for the stop strings: token t is the text "t,"
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return "".join(f"{t}," for t in ids)

    greedy = generate(model, prompt(6, 9), max_new_tokens=10).tolist()
    engine = Engine(model, tokenizer=Digits(), max_slots=2, page_size=4, eos_token_ids=[])
    by_id = engine.generate(
        [prompt(6, 9)], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[greedy[3]])
    )[0][0]
    assert by_id.token_ids == greedy[: greedy.index(greedy[3]) + 1]
    assert by_id.finish_reason == "stop"
    text = f"{greedy[2]},{greedy[3]},"
    by_text = engine.generate(
        [prompt(6, 9)], SamplingParams(max_tokens=10, temperature=0.0, stop=[text])
    )[0][0]
    assert by_text.finish_reason == "stop" and text not in by_text.text
    assert by_text.text == "".join(f"{t}," for t in greedy)[: by_text.text.__len__()]
    capped = engine.generate([prompt(6, 9)], SamplingParams(max_tokens=4, temperature=0.0))[0][0]
    assert capped.token_ids == greedy[:4] and capped.finish_reason == "length"


def test_seeded_sampling_depends_on_the_request_alone(model):
    params = SamplingParams(max_tokens=8, temperature=1.3, top_k=20, top_p=0.9, seed=11)
    alone = Engine(model, max_slots=1, page_size=4).generate([prompt(5, 1)], params)[0][0]
    crowded = Engine(model, max_slots=4, page_size=4)
    others = SamplingParams(max_tokens=12, temperature=0.7, seed=2)
    crowded.submit(prompt(9, 2), others)
    mine = crowded.submit(prompt(5, 1), params)
    crowded.submit(prompt(3, 3), others)
    done = []
    while not crowded.idle:
        done += crowded.step()
    (again,) = [c for c in done if c.request_id == mine]
    assert again.token_ids == alone.token_ids
    other_seed = Engine(model, max_slots=1, page_size=4).generate(
        [prompt(5, 1)], dataclasses.replace(params, seed=12)
    )[0][0]
    assert other_seed.token_ids != alone.token_ids


def test_the_steps_compile_once_per_bucket_over_many_requests(model):
    engine = Engine(model, max_slots=4, page_size=4, max_length=48)
    jax.clear_caches()
    with CompileLog() as log:
        for round_ in range(3):
            batch = [prompt(n, round_ * 10 + n) for n in (2, 5, 9, 14, 7, 3)]
            params = SamplingParams(max_tokens=5 + round_, temperature=0.8, seed=round_)
            engine.generate(batch, params)
        after_warm = sum(log.compiled.values())
        engine.generate(
            [prompt(n, 99 + n) for n in (4, 11, 6, 1, 8, 2)], SamplingParams(max_tokens=7)
        )
    compiled = log.compiled
    shapes = engine.steps.compiles
    assert compiled["_prefill_fn"] == len(shapes["prefill"]) <= 2  # buckets 16 and 32
    assert compiled["_decode_fn"] == len(shapes["decode"]) <= 3  # 1, 2 and 4 rows
    assert sum(compiled.values()) == after_warm  # a fourth round compiles nothing new


def test_engines_of_one_graph_share_their_compiled_steps(model):
    """A second engine of the same model graph and settings (another copy of the weights)
    compiles nothing and decodes its own weights' tokens; another page size is another
    program."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [prompt(5, 1), prompt(12, 2)]
    Engine(model, max_slots=2, page_size=4, max_length=32, eos_token_ids=[]).generate(
        prompts, params
    )
    other = tiny_llama(seed=7)  # the same graph, other weights
    with CompileLog() as log:
        second = Engine(other, max_slots=2, page_size=4, max_length=32, eos_token_ids=[])
        got = second.generate(prompts, params)
    steps = ("_prefill_fn", "_decode_fn", "<lambda>")
    assert second.steps.compiles["prefill"] and second.steps.compiles["decode"]
    assert not {name: n for name, n in log.compiled.items() if name in steps}, log.compiled
    assert [c[0].token_ids for c in got] == [
        generate(other, p, max_new_tokens=6).tolist() for p in prompts
    ]
    with CompileLog() as log:
        Engine(model, max_slots=2, page_size=8, max_length=32, eos_token_ids=[]).generate(
            prompts, params
        )
    assert log.compiled["_prefill_fn"] > 0 and log.compiled["_decode_fn"] > 0


def test_a_model_with_an_unhashable_attribute_gets_programs_of_its_own():
    """A graph that cannot key the shared programs (an attribute holding a dict) still
    serves, on programs of its own, the tokens of the same weights without it."""
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prompts = [prompt(6, 3), prompt(9, 4)]
    plain, noted = tiny_llama(seed=3), tiny_llama(seed=3)
    noted.notes = {"origin": ["a", "list"]}
    kw = dict(max_slots=2, page_size=4, max_length=32, eos_token_ids=[])
    engine = Engine(noted, **kw)
    got = [c[0].token_ids for c in engine.generate(prompts, params)]
    assert got == [c[0].token_ids for c in Engine(plain, **kw).generate(prompts, params)]
    assert engine.steps.programs is not Engine(noted, **kw).steps.programs


def test_steps_read_only_the_pages_in_use_and_decode_like_generate(model):
    """A table as wide as the longest sequence needs (a bucket of 8 pages and up), not
    max_length's 16 pages: sequences that cross from 8 to 16 pages mid-decode, and one that
    joins a wide step, still give generate's tokens."""
    engine = Engine(model, max_slots=2, page_size=4, max_length=64, eos_token_ids=[])
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [prompt(26, 4), prompt(3, 5), prompt(9, 6)]  # 26 + 12 tokens: pages 7 -> 10
    got = engine.generate(prompts, params)
    assert [c[0].token_ids for c in got] == [
        generate(model, p, max_new_tokens=12).tolist() for p in prompts
    ]
    widths = {table[1] for _, table in engine.steps.compiles["decode"]}
    assert widths == {8, 16}, engine.steps.compiles["decode"]
    assert {table[1] for _, table in engine.steps.compiles["prefill"]} == {8}


def test_pages_of_128_tokens_read_tables_of_one_page_and_up_and_decode_like_generate():
    """Pages of 128 tokens: the narrowest table is one page, not 8 (1,024 keys; steps.py's
    SMALLEST_TABLE_TOKENS); sequences of one page and of two (a 120-token prompt crossing into
    its second page mid-decode) give generate's greedy tokens, as do two samples sharing a
    prompt's full page."""
    model = tiny_llama(max_positions=256)
    engine = Engine(model, max_slots=3, page_size=128, max_length=256, eos_token_ids=[])
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [prompt(120, 7), prompt(5, 8)]
    got = engine.generate(prompts, params)
    assert [c[0].token_ids for c in got] == [
        generate(model, p, max_new_tokens=12).tolist() for p in prompts
    ]
    assert {table[1] for _, table in engine.steps.compiles["decode"]} == {1, 2}
    (group,) = engine.generate([prompt(130, 9)], params, n=2)  # both read its first page
    assert (
        group[0].token_ids
        == group[1].token_ids
        == generate(model, prompt(130, 9), max_new_tokens=12).tolist()
    )
    (key,) = prefix_keys(np.asarray(prompt(130, 9)), 128)  # whole pages: 128 of 130 tokens
    assert key in engine.pages.prefixes


def test_a_mixture_of_experts_model_decodes_like_generate():
    config = MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, max_position_embeddings=64, initializer_range=0.3,
    )  # fmt: skip
    moe = MoeForCausalLM(config, rngs=nnx.Rngs(1))
    batch = [prompt(n, n) for n in (4, 9, 2)]
    engine = Engine(moe, max_slots=2, page_size=4, eos_token_ids=[])
    got = engine.generate(batch, SamplingParams(max_tokens=6, temperature=0.0))
    assert [c[0].token_ids for c in got] == [
        generate(moe, p, max_new_tokens=6).tolist() for p in batch
    ]


def test_bad_requests_are_refused_with_the_reason(model):
    engine = Engine(model, max_slots=2, page_size=4, max_length=16)
    with pytest.raises(ArgumentError, match="exceeds the engine's max_length 16"):
        engine.submit(prompt(10), SamplingParams(max_tokens=8))
    with pytest.raises(ArgumentError, match="token id 61 is outside the vocabulary"):
        engine.submit([3, VOCAB], SamplingParams(max_tokens=2))
    with pytest.raises(ArgumentError, match="token id -1 is outside"):
        engine.submit([-1, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ArgumentError, match="n=3"):
        engine.submit(prompt(3), SamplingParams(max_tokens=4), n=3)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1.0)
    # Were truncated to ids, failed inside numpy, stopped at once, or never matched.
    with pytest.raises(ArgumentError, match="prompt token ids must be integers, got 1.5"):
        engine.submit([1.5, 2.7], SamplingParams(max_tokens=2))
    with pytest.raises(ArgumentError, match="not text: tokenize it first"):
        engine.submit("def f", SamplingParams(max_tokens=2))
    with pytest.raises(ArgumentError, match=r"stop_token_ids \[99999\] are outside"):
        engine.submit([3, 4], SamplingParams(max_tokens=2, stop_token_ids=[99999]))
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        SamplingParams(stop=[""])
    with pytest.raises(ValueError, match="seed must be an integer"):
        SamplingParams(seed=1.5)
    assert SamplingParams(seed=np.int64(7)).seed == 7  # GRPO's seeds are numpy's
    small = Engine(model, max_slots=2, page_size=4, max_length=16, num_pages=3)
    with pytest.raises(ArgumentError, match="needs 4 pages of 4 tokens; the KV cache has 2"):
        small.submit(prompt(8), SamplingParams(max_tokens=8))
    small.submit(prompt(7), SamplingParams(max_tokens=1), n=2)  # 2 pages each, 1 shared: 3
    with pytest.raises(ArgumentError, match="does not fit the KV cache even alone"):
        small.step()


def test_seeds_past_32_bits_draw_their_own_tokens(model):
    """A seed was folded to 32 bits by a multiplication: 2**40 drew seed 0's tokens."""
    engine = Engine(model, max_slots=2, page_size=4)
    draws = {}
    for seed in (0, 2**40, -1):
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
        draws[seed] = engine.generate([prompt(5)], params)[0][0].token_ids
    assert draws[0] != draws[2**40] and draws[-1] not in (draws[0], draws[2**40])


def test_a_gpt2_engine_stays_inside_its_learned_positions():
    """It decoded past GPT-2's position table, whose lookups clamp: garbage, in silence."""
    config = GPT2Config(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, max_position_embeddings=32)  # fmt: skip
    gpt2 = GPT2LMHeadModel(config, rngs=nnx.Rngs(0))
    with pytest.raises(ArgumentError, match="past this GPT-2's 32 learned positions"):
        Engine(gpt2, max_slots=1, page_size=4, max_length=128)
    assert Engine(gpt2, max_slots=1, page_size=4).max_length == 32


def test_new_parameters_drop_the_cached_prefixes_of_the_old_ones(model):
    """A GRPO run hands the engine new parameters every round, and its prompts share full
    pages (a system prompt, a prompt seen again next epoch): keys and values cached under the
    old parameters must not serve the new ones."""
    engine = Engine(model, max_slots=2, page_size=4, max_length=40, eos_token_ids=[])
    system = prompt(13, 5)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    engine.generate([system], greedy)
    _, state = nnx.split(model)
    other = jax.tree.map(lambda x: x * 1.5 if x.ndim == 2 else x, state)
    engine.update_state(other)
    [after] = engine.generate([system + prompt(2, 6)], greedy)[0]
    fresh = Engine(nnx.merge(nnx.graphdef(model), other), max_slots=2, page_size=4,
                   max_length=40, eos_token_ids=[])  # fmt: skip
    [want] = fresh.generate([system + prompt(2, 6)], greedy)[0]
    assert after.token_ids == want.token_ids
    assert after.logprobs == want.logprobs
    assert engine.pages.available == engine.pages.num_pages - 1


def test_a_moe_engine_records_the_experts_of_every_token_it_ran():
    """Routing replay's record: the experts each prompt and generated token went to in each
    sparse layer, through chunked prefill, a group's shared pages and decode steps, are the
    experts the full forward picks for the same tokens."""
    config = MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, max_position_embeddings=64, initializer_range=0.3,
        decoder_sparse_step=1, mlp_only_layers=[1],
    )  # fmt: skip
    moe = MoeForCausalLM(config, rngs=nnx.Rngs(2))
    engine = Engine(moe, max_slots=4, page_size=4, max_length=32, prefill_tokens=16,
                    eos_token_ids=[], record_routing=True)  # fmt: skip
    batch = [prompt(n, n) for n in (21, 6)]  # the first prefills in two chunks
    done = engine.generate(batch, SamplingParams(max_tokens=5, temperature=1.0, seed=3), n=2)
    # The full forward of every sequence, right-padded into one batch (causal: the padding
    # changes nothing before it); the last token never went through the model.
    runs = [(p + c.token_ids[:-1], c.routing) for p, group in zip(batch, done) for c in group]
    rows = np.zeros((len(runs), max(len(t) for t, _ in runs)), np.int32)
    for row, (tokens, _) in zip(rows, runs):
        row[: len(tokens)] = tokens
    _, want = jax.jit(lambda ids: moe.hidden_states(ids, return_routing=True))(rows)
    for (tokens, recorded), full in zip(runs, np.asarray(want)):
        assert recorded.shape == (2, len(tokens), 2)  # 2 sparse layers of 3
        np.testing.assert_array_equal(np.sort(recorded, -1), np.sort(full[:, : len(tokens)], -1))
    assert engine.pages.available == engine.pages.num_pages - 1
    with pytest.raises(ArgumentError, match="record_routing .* has no experts"):
        Engine(tiny_llama(), record_routing=True)
