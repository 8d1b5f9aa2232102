"""Prompts with images on the engine (issue 50, Gemma 3): greedy tokens equal `generate`'s
with the same images, with several image prompts and a text prompt prefilled together, with
a prefill budget that makes the engine cut the prompt into chunks (never inside an image), and
after a preemption; an image's pages are not shared through the prefix cache; after
`warm_up` nothing compiles."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from engine_models import CompileLog

sys.path.insert(0, str(Path(__file__).parents[1]))
from vlm_fixtures import picture, write_checkpoint  # noqa: E402

from jaxtrain.errors import ArgumentError  # noqa: E402
from jaxtrain.hf import AutoModelForCausalLM, load_tokenizer  # noqa: E402
from jaxtrain.models import generate  # noqa: E402
from jaxtrain.serving import Engine, SamplingParams  # noqa: E402

NEW = 6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    base = write_checkpoint(tmp_path_factory.mktemp("engine_vlm") / "base", seed=5)
    return AutoModelForCausalLM.from_pretrained(str(base)), load_tokenizer(base)


def vision_prompt(processor, question: str, images: list):
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    out = processor(text=[text], images=[images] if images else None, return_tensors="np",
                    add_special_tokens=False)  # fmt: skip
    return out["input_ids"][0], (out["pixel_values"] if images else None)


def run(engine: Engine, requests) -> list[list[int]]:
    ids = [
        engine.submit(p, SamplingParams(max_tokens=NEW, temperature=0.0), images=i)
        for p, i in requests
    ]
    done = {}
    while len(done) < len(ids):
        for completion in engine.step():
            done[completion.request_id] = completion.token_ids
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def cases(vlm):
    model, processor = vlm
    cases = [vision_prompt(processor, "describe this image", [picture(1)]),
             vision_prompt(processor, "what is in the picture and the colour of the shape",
                           [picture(2, 40, 20), picture(3)]),
             vision_prompt(processor, "what is a square", [])]  # fmt: skip
    expected = []
    for ids, images in cases:
        pixels = None if images is None else np.zeros((1, 2, 3, 32, 32), np.float32)
        if images is not None:
            pixels[0, : len(images)] = images
        expected.append(list(generate(model, ids, max_new_tokens=NEW, pixel_values=pixels)))
    return cases, expected


@pytest.mark.parametrize("prefill_tokens", [64, 12])
def test_image_prompts_give_generates_tokens(vlm, cases, prefill_tokens):
    model, _ = vlm
    prompts, expected = cases
    engine = Engine(model, max_slots=4, page_size=4, max_length=64, eos_token_ids=[],
                    prefill_tokens=prefill_tokens, max_images=2)  # fmt: skip
    assert run(engine, prompts) == expected
    assert run(engine, prompts[:1]) == expected[:1]  # again: nothing taken from the cache
    assert engine.steps.compiles["prefill_images"]


def test_a_preempted_image_prompt_is_recomputed_with_its_images(vlm, cases):
    model, _ = vlm
    prompts, expected = cases
    # Pages for one sequence and a bit: the second and third wait or are preempted.
    engine = Engine(model, max_slots=4, page_size=4, max_length=48, num_pages=14,
                    eos_token_ids=[], max_images=2)  # fmt: skip
    assert run(engine, prompts) == expected
    assert engine.preemptions > 0


def test_image_requests_are_checked(vlm, cases):
    model, _ = vlm
    prompts, _ = cases
    ids, images = prompts[0]
    engine = Engine(model, max_slots=2, page_size=4, max_length=64, max_images=1)
    with pytest.raises(ArgumentError, match="holds 1 image"):
        engine.submit(ids)
    with pytest.raises(ArgumentError, match=r"images must be \[1 \(the prompt's image runs\)"):
        engine.submit(ids, images=np.concatenate([images, images]))
    with pytest.raises(ArgumentError, match="at most max_images=1"):
        engine.submit(prompts[1][0], images=prompts[1][1])
    with pytest.raises(ArgumentError, match="does not fit one prefill call"):
        Engine(model, max_slots=2, page_size=4, max_length=64, prefill_tokens=3).submit(
            ids, images=images
        )


def test_nothing_compiles_after_warm_up(vlm, cases):
    model, _ = vlm
    prompts, expected = cases
    engine = Engine(model, max_slots=2, page_size=4, max_length=64, eos_token_ids=[],
                    max_images=2, prefill_tokens=32)  # fmt: skip
    engine.warm_up()
    with CompileLog() as log:
        assert run(engine, prompts) == expected
    assert not log.compiled, log.compiled
