"""The serving engine's greedy tokens equal `generate` and transformers' greedy on the same
checkpoints, every family the KV cache serves, with mixed prompt lengths and requests joining
while others decode (fewer slots than requests)."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import GEMMA_CASES, hf_gpt2, hf_model, random_ids, save_hf

from jaxtrain.hf import AutoModelForCausalLM
from jaxtrain.models import generate
from jaxtrain.serving import Engine, SamplingParams

NEW = 8
LENGTHS = (9, 3, 14, 6, 1)  # five prompts through three slots: later ones join mid-decode


def hf_greedy_one(model, prompt: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.as_tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            attention_mask=torch.ones_like(ids),
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def prompts(seed: int) -> list[list[int]]:
    ids = random_ids((len(LENGTHS), max(LENGTHS)), seed=seed)
    return [ids[i, :n].tolist() for i, n in enumerate(LENGTHS)]


def engine_greedy(model, batch: list[list[int]]) -> list[list[int]]:
    engine = Engine(model, max_slots=3, page_size=4, max_length=32, eos_token_ids=[])
    out = engine.generate(batch, SamplingParams(max_tokens=NEW, temperature=0.0))
    assert engine.pages.available == engine.pages.num_pages - 1  # every page back
    return [completions[0].token_ids for completions in out]


@pytest.mark.parametrize("name", ["llama", "mistral_sliding_window", "qwen3_qk_norm"])
def test_llama_family_greedy_equals_generate_and_transformers(name, tmp_path):
    reference = save_hf(name, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    batch = prompts(seed=7)
    got = engine_greedy(model, batch)
    assert got == [generate(model, p, max_new_tokens=NEW).tolist() for p in batch]
    assert got == [hf_greedy_one(reference, p) for p in batch]


@pytest.mark.parametrize("name", ["gemma2", "gpt2"])
def test_gemma_and_gpt2_greedy_equal_transformers(name, tmp_path):
    """Gemma 2's sliding window (5) and soft-capping; GPT-2's learned positions."""
    reference = hf_gpt2() if name == "gpt2" else hf_model(GEMMA_CASES[name]())
    reference.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    batch = prompts(seed=8)
    got = engine_greedy(model, batch)
    assert got == [hf_greedy_one(reference, p) for p in batch]
