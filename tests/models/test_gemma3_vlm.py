"""Gemma 3 with images equals transformers' Gemma3ForConditionalGeneration on the same weights:
logits of rows holding images (two in one row, one in another: their soft tokens in order,
each image's tokens attending both ways, within the sliding layers' window too) and of a text
row, float32, rel 1e-4; a transformers directory loads with `AutoModelForCausalLM`, and
jaxtrain's export loads back in transformers with the same logits (issue 50)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_gemma3_vision import VISION

from jaxtrain.errors import HFError
from jaxtrain.hf.gemma3_vlm import load_gemma3_vlm

IMG = 299
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, vocab_size=300, sliding_window=6,
            layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=10000.0,
            query_pre_attn_scalar=32)  # fmt: skip


@pytest.fixture(scope="module")
def hf_model():
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=IMG
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    projector = model.model.multi_modal_projector
    with torch.no_grad():  # zeros at init: random, so that the comparison can fail
        projector.mm_input_projection_weight.normal_(0, 0.2)
        projector.mm_soft_emb_norm.weight.normal_(0, 0.2)
    return model


def rows() -> np.ndarray:
    image = [IMG] * 4
    return np.array(
        [
            [2, 10, 11, *image, 12, 13, 14, *image, 15, 16],
            [2, 20, *image, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
        ]
    )


def test_logits_with_images_equal_transformers(hf_model):
    config = hf_model.config.to_dict()
    weights = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    model = load_gemma3_vlm(config, weights)
    ids = rows()
    images = np.random.default_rng(0).normal(size=(3, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        theirs = hf_model(
            input_ids=torch.as_tensor(ids), pixel_values=torch.as_tensor(images),
            token_type_ids=torch.as_tensor((ids == IMG).astype(np.int64)),
        ).logits.numpy()  # fmt: skip
        causal_only = hf_model(
            input_ids=torch.as_tensor(ids), pixel_values=torch.as_tensor(images)
        ).logits.numpy()
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(images)))
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    # The images' two-way attention is exercised: causal attention gives other logits.
    assert np.abs(theirs - causal_only).max() > 1e-3

    text = np.array([[2, 10, 11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        plain = hf_model(input_ids=torch.as_tensor(text)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(text))), plain, rtol=1e-4, atol=1e-4)


def test_a_missing_decoder_tensor_and_another_model_type_are_named(hf_model):
    config = hf_model.config.to_dict()
    weights = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    name = next(
        k for k in weights if k.endswith("layers.1.mlp.down_proj.weight") and "language" in k
    )
    del weights[name]
    with pytest.raises(HFError, match=r"layers\.1\.mlp\.down_proj\.weight"):
        load_gemma3_vlm(config, weights)
    with pytest.raises(HFError, match="'gemma3_text' is not 'gemma3'"):
        load_gemma3_vlm({**config, "model_type": "gemma3_text"}, weights)


def logits_of(hf_model, ids, images):
    with torch.no_grad():
        return hf_model(
            input_ids=torch.as_tensor(ids), pixel_values=torch.as_tensor(images),
            token_type_ids=torch.as_tensor((ids == IMG).astype(np.int64)),
        ).logits.numpy()  # fmt: skip


def test_a_transformers_directory_loads_and_exports_back(hf_model, tmp_path):
    from jaxtrain.hf import AutoModelForCausalLM, save_pretrained

    hf_model.save_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = rows()
    images = np.random.default_rng(1).normal(size=(3, 3, 32, 32)).astype(np.float32)
    want = logits_of(hf_model, ids, images)
    ours = np.asarray(model(jnp.asarray(ids), jnp.asarray(images)))
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-4)

    save_pretrained(model, tmp_path / "export")
    back = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    np.testing.assert_allclose(logits_of(back, ids, images), want, rtol=1e-4, atol=1e-4)
