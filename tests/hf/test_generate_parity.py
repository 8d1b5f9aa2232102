"""KV-cache generation gives transformers' own greedy tokens on the HF parity models: the
Llama family, Gemma 2 / 3 and GPT-2."""

import numpy as np
import pytest
import torch
from hf_fixtures import CASES, GEMMA_CASES, hf_gpt2, hf_model, random_ids, save_hf

from jaxtrain.hf import AutoModelForCausalLM
from jaxtrain.models import generate
from jaxtrain.models.kv_cache import supports_kv_cache

NEW = 10


def hf_greedy(model, prompts: np.ndarray, attention_mask: np.ndarray | None = None):
    model.generation_config.eos_token_id = None  # run every row to NEW tokens
    model.generation_config.pad_token_id = 0
    if attention_mask is None:  # else HF guesses a mask from pad_token_id
        attention_mask = np.ones_like(prompts)
    with torch.no_grad():
        out = model.generate(torch.as_tensor(prompts), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, attention_mask=torch.as_tensor(attention_mask))  # fmt: skip
    return out[:, prompts.shape[1] :].numpy()


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_tokens_equal_transformers_generate(name, tmp_path):
    reference = save_hf(name, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    prompts = random_ids((2, 9), seed=4)
    want = hf_greedy(reference, prompts)
    got = generate(model, prompts, max_new_tokens=NEW)
    np.testing.assert_array_equal(got, want)


def test_left_padded_batch_equals_transformers(tmp_path):
    reference = save_hf("llama3_rope", tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = random_ids((2, 9), seed=5)
    mask = np.ones_like(ids)
    mask[0, :4] = 0  # row 0 is a 5-token prompt, left-padded
    want = hf_greedy(reference, np.where(mask == 1, ids, 0), mask)
    got = generate(model, [ids[0, 4:].tolist(), ids[1].tolist()], max_new_tokens=NEW)
    np.testing.assert_array_equal(got, want)


def other_family(name: str, directory):
    """(transformers model, jaxtrain model) of a Gemma case or GPT-2, saved and reloaded."""
    reference = hf_gpt2() if name == "gpt2" else hf_model(GEMMA_CASES[name]())
    reference.save_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert supports_kv_cache(model)  # the cached path is the one under test
    return reference, model


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "gpt2"])
def test_gemma_and_gpt2_greedy_tokens_equal_transformers(name, tmp_path):
    """Prompt 9 + 10 new tokens pass Gemma's sliding window of 5; a left-padded row too."""
    reference, model = other_family(name, tmp_path)
    prompts = random_ids((2, 9), seed=4)
    np.testing.assert_array_equal(
        generate(model, prompts, max_new_tokens=NEW), hf_greedy(reference, prompts)
    )
    mask = np.ones_like(prompts)
    mask[0, :4] = 0  # row 0 is a 5-token prompt, left-padded
    want = hf_greedy(reference, np.where(mask == 1, prompts, 0), mask)
    got = generate(model, [prompts[0, 4:].tolist(), prompts[1].tolist()], max_new_tokens=NEW)
    np.testing.assert_array_equal(got, want)
