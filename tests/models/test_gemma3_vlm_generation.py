"""Generation with images (issue 50): greedy tokens of Gemma 3 from a prompt holding an image
equal transformers' `generate`; prompts of different lengths in one left-padded batch give
what each gives alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from vlm_fixtures import picture, write_checkpoint

from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer
from jaxtrain.models import generate

NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("gemma3_vlm_generate") / "base", seed=3)


def prompt(processor, question: str, image):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor(text=[text], images=[[image]], return_tensors="np", add_special_tokens=False)


def test_greedy_tokens_with_an_image_equal_transformers(checkpoint):
    processor = load_tokenizer(checkpoint)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    ours = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    inputs = [prompt(processor, "describe this image", picture(1)),
              prompt(processor, "what is in the picture and what colour", picture(2, 40, 20))]  # fmt: skip
    alone = []
    for x in inputs:
        with torch.no_grad():
            theirs = hf.generate(
                input_ids=torch.as_tensor(x["input_ids"]),
                attention_mask=torch.as_tensor(x["attention_mask"]),
                pixel_values=torch.as_tensor(x["pixel_values"]),
                token_type_ids=torch.as_tensor(x["token_type_ids"]),
                max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW,
            )[0, x["input_ids"].shape[1] :].numpy()  # fmt: skip
        mine = generate(ours, x["input_ids"], max_new_tokens=NEW,
                        pixel_values=x["pixel_values"][None])  # fmt: skip
        np.testing.assert_array_equal(mine[0], theirs)
        alone.append(mine[0])
    # The image decides: another picture gives other tokens.
    other = generate(ours, inputs[0]["input_ids"], max_new_tokens=NEW,
                     pixel_values=inputs[1]["pixel_values"][None])  # fmt: skip
    assert not np.array_equal(other[0], alone[0])
    # Both prompts in one batch (the shorter left-padded): each row as alone.
    both = generate(ours, [x["input_ids"][0] for x in inputs], max_new_tokens=NEW,
                    pixel_values=np.stack([x["pixel_values"] for x in inputs]))  # fmt: skip
    np.testing.assert_array_equal(both, np.stack(alone))
