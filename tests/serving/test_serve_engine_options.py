"""`jaxtrain serve`'s engine options reach the engine: the KV budget, the prefill chunk,
speculation and the attention path, each parsed from the command line; a bad one is named."""

from __future__ import annotations

import pytest
from flax import nnx

from jaxtrain.cli.serve import build_engine, parse_serve_options
from jaxtrain.errors import ArgumentError
from jaxtrain.models import LlamaConfig, LlamaForCausalLM
from jaxtrain.serving.paged import page_bytes


@pytest.fixture(scope="module")
def model():
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(config, rngs=nnx.Rngs(0))


def test_the_engine_options_reach_the_engine(model):
    gib = 10 * page_bytes(model, 16) / 2**30  # of the 4 slots x 4 pages the context needs
    _, options = parse_serve_options(
        ["model_dir", "--kv_cache_gib", str(gib), "--prefill_tokens", "64",
         "--speculative_tokens", "3", "--attention", "interpret", "--max_slots", "4",
         "--page_size", "16"]
    )  # fmt: skip
    engine = build_engine(model, None, options)
    assert engine.pages.num_pages == 10 + 1
    assert (engine.prefill_tokens, engine.speculative_tokens) == (64, 3)
    assert engine.steps.kernel == "interpret" and engine.max_slots == 4
    assert engine.page_size == 16
    plain = build_engine(model, None, parse_serve_options(["model_dir"])[1])
    assert plain.steps.kernel == "gather" and plain.speculative_tokens == 0
    assert plain.page_size == 16


def test_a_bad_engine_option_is_named(model):
    with pytest.raises(ArgumentError, match="--prefill_tokens 'many': expected int"):
        parse_serve_options(["model_dir", "--prefill_tokens", "many"])
    _, options = parse_serve_options(["model_dir", "--attention", "flash"])
    with pytest.raises(ArgumentError, match="attention must be auto, gather, pallas or interpret"):
        build_engine(model, None, options)
    _, options = parse_serve_options(["model_dir", "--memory_fraction", "0.5"])
    with pytest.raises(ArgumentError, match="memory_fraction needs a device that reports"):
        build_engine(model, None, options)
