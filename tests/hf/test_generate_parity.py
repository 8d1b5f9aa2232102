"""KV-cache generation gives transformers' own greedy tokens on the HF parity models."""

import numpy as np
import pytest
import torch
from hf_fixtures import CASES, random_ids, save_hf

from jaxtrain.models import AutoModelForCausalLM, generate

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
