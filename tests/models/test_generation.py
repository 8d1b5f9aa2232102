"""generate(): greedy equals a hand-written argmax loop, eos/length rules, one compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, generate
from jaxtrain.models.gemma import GemmaConfig, GemmaForCausalLM
from jaxtrain.models.generation import _generate_cached
from jaxtrain.models.kv_cache import supports_kv_cache
from jaxtrain.models.moe import MoeConfig, MoeForCausalLM

CFG = LlamaConfig(
    vocab_size=53,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.3,  # peaked logits: argmax is not decided by rounding noise
)

TRACES: list[int] = []


class CountingLM(nnx.Module):
    """Wraps a model and records each time its call is traced (a Python side effect)."""

    def __init__(self, inner: nnx.Module):
        self.inner = inner

    def __call__(self, input_ids, **kwargs):
        TRACES.append(1)
        return self.inner(input_ids, **kwargs)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM(CFG, rngs=nnx.Rngs(3))


def prompt(length: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, CFG.vocab_size, size=(length,))


def argmax_loop(model, prompt_ids: np.ndarray, steps: int) -> list[int]:
    fwd = nnx.jit(lambda m, x: m(x))
    tokens = list(prompt_ids)
    for _ in range(steps):
        logits = fwd(model, jnp.asarray([tokens]))
        tokens.append(int(jnp.argmax(logits[0, -1])))
    return tokens[len(prompt_ids) :]


def test_greedy_matches_a_step_by_step_argmax_loop(model):
    p = prompt(5)
    expected = argmax_loop(model, p, 6)
    got = generate(model, p, max_new_tokens=6)
    assert got.dtype == np.int32 and got.shape == (6,)
    assert got.tolist() == expected
    # Degenerate output would make the comparison meaningless.
    assert len(set(expected)) > 1


def test_stops_at_eos_and_drops_what_follows(model):
    p = prompt(4, seed=1)
    full = generate(model, p, max_new_tokens=10).tolist()
    stop = 3
    eos = full[stop]
    first = full.index(eos)  # eos may already occur earlier in the continuation
    got = generate(model, p, max_new_tokens=10, eos_token_id=eos).tolist()
    assert got == full[: first + 1]
    # A list of eos ids works too (Llama 3 configs carry several).
    assert generate(model, p, max_new_tokens=10, eos_token_id=[999, eos]).tolist() == got


def test_batched_prompts_match_single_prompts(model):
    rows = np.stack([prompt(6, seed=2), prompt(6, seed=3)])
    out = generate(model, rows, max_new_tokens=5)
    assert out.shape == (2, 5)
    for row, gen in zip(rows, out):
        assert gen.tolist() == generate(model, row, max_new_tokens=5).tolist()


def test_same_length_prompts_compile_once(model):
    wrapped = CountingLM(model)
    TRACES.clear()
    a = generate(wrapped, prompt(6, seed=4), max_new_tokens=6)
    traces_after_first = len(TRACES)
    b = generate(wrapped, prompt(6, seed=5), max_new_tokens=6)
    assert traces_after_first >= 1
    assert len(TRACES) == traces_after_first, "second call re-traced the decode loop"
    assert a.tolist() != b.tolist()
    # Shorter prompt with more new tokens: same buffer length, still no new compile.
    generate(wrapped, prompt(4, seed=6), max_new_tokens=8)
    assert len(TRACES) == traces_after_first


def test_sampling_is_seeded_and_top_k_1_is_greedy(model):
    p = prompt(5, seed=7)
    greedy = generate(model, p, max_new_tokens=6)
    s1 = generate(model, p, max_new_tokens=6, temperature=1.5, seed=1)
    assert s1.tolist() == generate(model, p, max_new_tokens=6, temperature=1.5, seed=1).tolist()
    draws = {tuple(generate(model, p, max_new_tokens=6, temperature=1.5, seed=s)) for s in range(4)}
    assert len(draws) > 1
    top1 = generate(model, p, max_new_tokens=6, temperature=1.5, top_k=1, seed=2)
    assert top1.tolist() == greedy.tolist()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2, "temperature": -1.0}, "temperature"),
        ({"max_new_tokens": 2, "top_k": 0}, "top_k"),
    ],
)
def test_bad_arguments_are_rejected(model, kwargs, field):
    with pytest.raises(ValueError, match=field):
        generate(model, prompt(3), **kwargs)
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(model, np.zeros((1, 2, 3), np.int32), max_new_tokens=2)


@pytest.mark.parametrize("extra", [{}, {"sliding_window": 4, "qk_norm": True}])
def test_kv_cache_greedy_equals_the_cache_free_path(extra):
    model = LlamaForCausalLM(LlamaConfig(**{**CFG.to_dict(), **extra}), rngs=nnx.Rngs(5))
    assert_cache_matches_cache_free(model, np.stack([prompt(7, seed=8), prompt(7, seed=9)]))


def assert_cache_matches_cache_free(model, rows: np.ndarray) -> None:
    """12 greedy tokens per row with and without the KV cache are the same (and not a
    degenerate repeat); an eos taken from that output stops a row right after it."""
    cached = generate(model, rows, max_new_tokens=12)
    plain = generate(model, rows, max_new_tokens=12, use_cache=False)
    assert cached.shape == (2, 12) and cached.tolist() == plain.tolist()
    assert len(set(cached.ravel().tolist())) > 2
    eos = int(plain[0, 5])
    stopped = generate(model, rows[0], max_new_tokens=12, eos_token_id=eos)
    assert stopped.tolist() == plain[0, : plain[0].tolist().index(eos) + 1].tolist()


def test_mixture_of_experts_decodes_with_the_cache_too():
    config = MoeConfig(
        vocab_size=53, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=24, mlp_only_layers=[1],
        initializer_range=0.3, model_type="qwen2_moe",
    )  # fmt: skip
    model = MoeForCausalLM(config, rngs=nnx.Rngs(6))
    assert supports_kv_cache(model)
    rows = np.stack([prompt(7, seed=10), prompt(7, seed=11)])
    cached = generate(model, rows, max_new_tokens=10)
    assert cached.tolist() == generate(model, rows, max_new_tokens=10, use_cache=False).tolist()
    assert len(set(cached.ravel().tolist())) > 2
    # A capacity limit routes one step's tokens differently: no cache then.
    capped = MoeForCausalLM(MoeConfig(**{**config.to_dict(), "capacity_factor": 1.0}),
                            rngs=nnx.Rngs(6))  # fmt: skip
    assert not supports_kv_cache(capped)


def test_prompts_of_different_lengths_are_left_padded(model):
    prompts = [prompt(3, seed=10), prompt(8, seed=11), prompt(5, seed=12)]
    out = generate(model, [p.tolist() for p in prompts], max_new_tokens=6)
    assert out.shape == (3, 6)
    for p, gen in zip(prompts, out):
        assert gen.tolist() == generate(model, p, max_new_tokens=6, use_cache=False).tolist()
    with pytest.raises(ValueError, match="different lengths"):
        generate(model, [p.tolist() for p in prompts], max_new_tokens=2, use_cache=False)


def test_top_p_keeps_the_nucleus(model):
    p = prompt(5, seed=13)
    greedy = generate(model, p, max_new_tokens=6)
    assert generate(model, p, max_new_tokens=6, temperature=1.0, top_p=1e-6).tolist() == (
        greedy.tolist()
    )  # only the most likely token is in a tiny nucleus
    draws = {tuple(generate(model, p, max_new_tokens=6, temperature=2.0, top_p=0.9, seed=s))
             for s in range(4)}  # fmt: skip
    assert len(draws) > 1
    with pytest.raises(ValueError, match="top_p"):
        generate(model, p, max_new_tokens=2, top_p=0.0)


def test_sampling_without_a_nucleus_sorts_nothing(model):
    """top_p = 1 keeps every token: the vocabulary is not sorted at each step (a [B, V] sort
    per token made sampled generation ~3x slower than greedy on SmolLM2's 49k vocabulary)."""
    graphdef, state = nnx.split(model)
    prompt_ids, pad = jnp.zeros((2, 4), jnp.int32), jnp.zeros(2, jnp.int32)
    args = (graphdef, state, prompt_ids, pad, jax.random.key(0), jnp.float32(1.0))

    def hlo(top_p: float) -> str:
        return _generate_cached.lower(
            *args, jnp.float32(top_p), jnp.asarray([2], jnp.int32), max_new=3, sample=True,
            top_k=None, nucleus=top_p < 1,
        ).as_text()  # fmt: skip

    assert "stablehlo.sort" not in hlo(1.0)
    assert "stablehlo.sort" in hlo(0.9)


GEMMA = dict(
    vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
    query_pre_attn_scalar=16, initializer_range=0.3, tie_word_embeddings=False,
)  # fmt: skip


@pytest.mark.parametrize(
    "build",
    [
        lambda: GemmaForCausalLM(
            GemmaConfig(**GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
            rngs=nnx.Rngs(7),
        ),
        lambda: GemmaForCausalLM(
            GemmaConfig(
                **GEMMA,
                model_type="gemma3_text",
                qk_norm=True,
                rope_local_base_freq=1e4,
            ),
            rngs=nnx.Rngs(7),
        ),  # fmt: skip
        lambda: GPT2LMHeadModel(
            GPT2Config(
                vocab_size=53,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=24,
                initializer_range=0.3,
            ),
            rngs=nnx.Rngs(7),
        ),  # fmt: skip
    ],
    ids=["gemma2", "gemma3_text", "gpt2"],
)
def test_gemma_and_gpt2_decode_with_the_cache_like_the_cache_free_path(build):
    """12 new tokens after 7 pass the sliding window of 4; eos stops a row the same way."""
    model = build()
    assert supports_kv_cache(model)
    rows = np.stack([prompt(7, seed=12), prompt(7, seed=13)])
    assert_cache_matches_cache_free(model, rows)
    if isinstance(model, GPT2LMHeadModel):  # learned positions end at 24
        with pytest.raises(ValueError, match="max_position_embeddings"):
            generate(model, rows, max_new_tokens=20)
