"""Attention that reads the pages in place: JAX's Pallas paged-attention kernel (the GPU one,
run in Pallas' interpret mode on this CPU) against the gather path, on one decode step and on
whole generations of a Llama (grouped-query) and a Gemma 2 (soft-capped logits, sliding
layers on the gather path): the same outputs and the same greedy tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models import LlamaConfig, LlamaForCausalLM, generate
from jaxtrain.models.gemma import GemmaConfig, GemmaForCausalLM
from jaxtrain.serving import Engine, SamplingParams
from jaxtrain.serving.paged import PagedSlots, decode_row_group


@pytest.mark.parametrize("cap", [None, 2.0])
def test_the_kernel_reads_the_pages_as_the_gather_path_does(cap):
    rng = np.random.default_rng(0)
    heads, kv_heads, dim, pages, size, width = 8, 2, 16, 30, 4, 8
    keys, values = (jnp.asarray(rng.normal(size=(kv_heads, pages, size, dim)), jnp.float32)
                    for _ in range(2))  # fmt: skip
    q = jnp.asarray(rng.normal(size=(3, 1, heads, dim)), jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[: 3 * width].reshape(3, width))
    start = jnp.asarray([0, 9, 31], jnp.int32)  # one key, a few pages, the whole table
    out = {}
    for kernel in ("gather", "interpret"):
        slots = PagedSlots.of(start, 1, table, size, kernel=kernel)
        out[kernel] = slots.attention(q, keys, values, slots.mask(), scale=0.3, logit_cap=cap)
    np.testing.assert_allclose(out["interpret"], out["gather"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [24, 12, 9])
def test_a_cpu_decode_step_attends_by_row_groups_as_each_row_alone_would(rows):
    """Past 8 rows a CPU decode step gathers its pages a group of rows at a time (in a loop:
    the pages stay in cache); each row's output is its own attention."""
    rng = np.random.default_rng(1)
    heads, kv_heads, dim, size, width = 6, 2, 8, 4, 5
    pages = rows * width + 1
    keys, values = (jnp.asarray(rng.normal(size=(kv_heads, pages, size, dim)), jnp.float32)
                    for _ in range(2))  # fmt: skip
    q = jnp.asarray(rng.normal(size=(rows, 1, heads, dim)), jnp.float32)
    table = rng.permutation(np.arange(1, pages)).reshape(rows, width)
    start = rng.integers(0, width * size, rows)
    group = decode_row_group(jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]))
    slots = PagedSlots.of(jnp.asarray(start), 1, jnp.asarray(table), size, row_group=group)
    step = lambda q, k, v: slots.attention(q, k, v, slots.mask(), scale=0.3, logit_cap=2.0)  # noqa: E731
    assert "scan" in str(jax.make_jaxpr(step)(q, keys, values))  # the groups' loop
    out = np.asarray(step(q, keys, values))
    per_kv = heads // kv_heads
    for r in range(rows):
        seen = start[r] + 1
        k_r, v_r = (np.asarray(x)[:, table[r]].reshape(kv_heads, -1, dim)[:, :seen]
                    for x in (keys, values))  # fmt: skip
        for n in range(heads):
            logits = 2.0 * np.tanh(0.3 * k_r[n // per_kv] @ np.asarray(q[r, 0, n]) / 2.0)
            probs = np.exp(logits - logits.max())
            want = (probs / probs.sum()) @ v_r[n // per_kv]
            np.testing.assert_allclose(out[r, 0, n], want, rtol=1e-5, atol=1e-5)


def test_a_cpu_decode_row_group_reads_only_the_pages_its_longest_row_reaches():
    """Rows go in order of length and a group gathers the table's columns up to its longest
    row's page (in quarters of the table): pages past that are never read. They hold NaN
    here, which reading would spread even through a zero weight (0 * NaN)."""
    rng = np.random.default_rng(2)
    heads, kv_heads, dim, size, width, rows = 4, 2, 8, 4, 8, 16
    keys, values = (rng.normal(size=(kv_heads, rows * width + 2, size, dim)).astype(np.float32)
                    for _ in range(2))  # fmt: skip
    table = 2 + np.arange(rows * width).reshape(rows, width)
    start = rng.permutation(
        np.r_[rng.integers(0, 2 * size, 8), rng.integers(2 * size, width * size, 8)]
    )
    short = start < 2 * size  # eight rows within the table's first quarter: one group
    for pool in (keys, values):
        pool[:, table[short, 2:]] = np.nan
    group = decode_row_group(jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]))
    slots = PagedSlots.of(jnp.asarray(start), 1, jnp.asarray(table), size, row_group=group)
    q = jnp.asarray(rng.normal(size=(rows, 1, heads, dim)), jnp.float32)
    out = np.asarray(slots.attention(q, jnp.asarray(keys), jnp.asarray(values), slots.mask()))
    assert np.isfinite(out).all()
    clean = [np.nan_to_num(x, nan=0.0) for x in (keys, values)]
    want = PagedSlots.of(jnp.asarray(start), 1, jnp.asarray(table), size)  # all rows at once
    np.testing.assert_allclose(out, want.attention(q, *map(jnp.asarray, clean), want.mask()),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def tiny_gemma2(sliding_window: int, seed: int) -> GemmaForCausalLM:
    """A 3-layer Gemma 2: grouped-query, sliding layers, soft-capped logits."""
    config = GemmaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=sliding_window,
        query_pre_attn_scalar=16, initializer_range=0.3, tie_word_embeddings=False,
        attn_logit_softcapping=2.0, max_position_embeddings=64,
    )  # fmt: skip
    return GemmaForCausalLM(config, rngs=nnx.Rngs(seed))


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_an_engine_on_the_kernel_decodes_like_generate(family):
    if family == "llama":
        config = LlamaConfig(
            vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            initializer_range=0.3,
        )  # fmt: skip
        model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    else:
        model = tiny_gemma2(sliding_window=4, seed=7)
    prompts = [np.random.default_rng(n).integers(3, 61, n).tolist() for n in (3, 11, 6)]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=1)
    kwargs = dict(max_slots=4, page_size=4, max_length=32, eos_token_ids=[])
    gathered = Engine(model, **kwargs).generate(prompts, params)
    kernel = Engine(model, attention="interpret", **kwargs).generate(prompts, params)
    for a, b, p in zip(kernel, gathered, prompts):
        assert a[0].token_ids == b[0].token_ids == generate(model, p, max_new_tokens=10).tolist()
        np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, rtol=1e-5, atol=1e-5)


def test_sixteen_rows_of_staggered_lengths_decode_as_four_at_a_time():
    """An engine of 16 slots decodes in row groups, rows in order of length, each group
    gathering the part of the table its longest row reaches (Gemma 2: sliding layers and
    soft-capped logits too); one of 4 slots gathers every row's whole table. Same greedy
    tokens, same log-probs."""
    model = tiny_gemma2(sliding_window=6, seed=3)
    lengths = 1 + 3 * np.random.default_rng(0).permutation(16)  # rows out of length order
    prompts = [np.random.default_rng(n).integers(3, 61, n).tolist() for n in lengths]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1)
    kwargs = dict(page_size=4, max_length=64, eos_token_ids=[])
    grouped = Engine(model, max_slots=16, **kwargs)
    assert 0 < grouped.steps.programs.row_group < 16  # its 16-row steps go by groups
    together = Engine(model, max_slots=4, **kwargs).generate(prompts, params)
    for a, b in zip(grouped.generate(prompts, params), together):
        assert a[0].token_ids == b[0].token_ids
        np.testing.assert_allclose(a[0].logprobs, b[0].logprobs, rtol=1e-5, atol=1e-5)
