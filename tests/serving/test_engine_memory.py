"""The KV pool under a memory budget: sized from kv_cache_gib, pages taken as sequences grow,
the youngest sequences preempted and recomputed when the pool runs out (greedy tokens still
generate's, seeded samples still the unpreempted engine's, every page back at the end), and
cached prefixes evicted least recently used, a prefix's last pages first."""

from __future__ import annotations

import numpy as np
import pytest
from engine_models import prompt, tiny_llama

from jaxtrain.errors import ArgumentError
from jaxtrain.models import generate
from jaxtrain.serving import Engine, SamplingParams
from jaxtrain.serving.paged import PageAllocator, prefix_keys


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def run(engine: Engine, batch: list[list[int]], params: SamplingParams) -> tuple[dict, int]:
    """Every completion's tokens by (prompt, sample), and the most pages ever in use."""
    ids = [engine.submit(p, params, n=2) for p in batch]
    out, peak = {}, 0
    while not engine.idle:
        for c in engine.step():
            out[ids.index(c.request_id), c.index] = c.token_ids
        peak = max(peak, engine.pages.num_pages - 1 - len(engine.pages.free))
    return out, peak


def test_sequences_preempted_when_the_pool_runs_out_give_the_same_tokens(model):
    batch = [prompt(n, n) for n in (6, 9, 5, 11)]
    # 8 sequences of up to 11 + 24 tokens: 9 pages each, 72 in all without sharing; 20 here.
    small = Engine(model, max_slots=8, page_size=4, max_length=48, num_pages=21, eos_token_ids=[])
    large = Engine(model, max_slots=8, page_size=4, max_length=48, eos_token_ids=[])
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    got, peak = run(small, batch, greedy)
    assert small.preemptions > 0 and peak <= 20
    for (p, i), tokens in got.items():
        assert tokens == generate(model, batch[p], max_new_tokens=24).tolist(), (p, i)
    assert small.pages.available == small.pages.num_pages - 1
    sampled = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=3)
    before = small.preemptions
    assert run(small, batch, sampled)[0] == run(large, batch, sampled)[0]
    assert small.preemptions > before and large.preemptions == 0
    assert small.pages.available == small.pages.num_pages - 1


def test_the_pool_is_sized_from_a_memory_budget(model):
    c = model.config
    page = 2 * c.num_hidden_layers * 4 * c.num_key_value_heads * c.head_dim * 4  # float32
    budget = 100 * page + page // 2
    engine = Engine(model, max_slots=8, page_size=4, kv_cache_gib=budget / 2**30)
    assert engine.pages.num_pages == 100 + 1  # page 0 is the garbage page
    assert sum(k.nbytes + v.nbytes for k, v in engine.pool) == 101 * page
    roomy = Engine(model, max_slots=2, page_size=4, kv_cache_gib=1.0)
    assert roomy.pages.num_pages == 2 * 16 + 1  # never more than every slot at max_length
    with pytest.raises(ArgumentError, match="memory_fraction needs a device that reports"):
        Engine(model, memory_fraction=0.5)
    with pytest.raises(ArgumentError, match="not both"):
        Engine(model, kv_cache_gib=1.0, memory_fraction=0.5)


def test_cached_prefixes_are_evicted_least_recently_used_last_pages_first():
    pages = PageAllocator(num_pages=8, page_size=2)
    a, b = prefix_keys(np.arange(6), 2), prefix_keys(np.arange(10, 16), 2)
    a_pages, b_pages = pages.allocate(3), pages.allocate(3)
    pages.remember(a, a_pages)
    pages.remember(b, b_pages)
    pages.release(a_pages + b_pages)  # only the cache holds them now
    assert pages.cached_prefix(a) == a_pages  # a used again: b is the least recent
    pages.allocate(2)  # one free page, then one evicted: b's last page
    assert pages.cached_prefix(b) == b_pages[:2] and pages.cached_prefix(a) == a_pages
    pages.allocate(1)  # b's last page was its second: now b is one page, then a's last
    assert pages.cached_prefix(b) == b_pages[:1]
