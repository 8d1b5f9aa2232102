"""Gemma 3's image encoder (the SigLIP tower and the projector) equals transformers' on the same
weights and images: the tower's patches and the image tokens
(`Gemma3Model.get_image_features`), float32, rel 1e-5. The first part of Gemma 3's vision
model (issue 50); the decoder taking the image tokens comes next."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxtrain.errors import HFError
from jaxtrain.hf.gemma3_vision import load_image_encoder, siglip_from_hf

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              image_size=32, patch_size=8)  # fmt: skip
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, vocab_size=300)  # fmt: skip


@pytest.fixture(scope="module")
def hf_model():
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, image_token_index=299
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    projector = model.model.multi_modal_projector
    with torch.no_grad():  # zeros at init: random, so that the comparison can fail
        projector.mm_input_projection_weight.normal_(0, 0.2)
        projector.mm_soft_emb_norm.weight.normal_(0, 0.2)
    return model


def test_image_tokens_equal_transformers(hf_model):
    config = hf_model.config
    weights = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    encoder = load_image_encoder(
        weights, siglip_from_hf(config.vision_config.to_dict()),
        config.text_config.hidden_size, config.mm_tokens_per_image,
    )  # fmt: skip
    images = np.random.default_rng(0).normal(size=(3, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        out = hf_model.model.get_image_features(torch.as_tensor(images))
    patches = np.asarray(encoder.vision_tower(jnp.asarray(images)))
    np.testing.assert_allclose(patches, out.last_hidden_state.numpy(), rtol=1e-5, atol=1e-5)
    tokens = np.asarray(encoder(jnp.asarray(images)))
    assert tokens.shape == (3, 4, 64)  # 4 x 4 patches pooled to 2 x 2 image tokens
    np.testing.assert_allclose(tokens, out.pooler_output.numpy(), rtol=1e-5, atol=1e-5)
    assert np.abs(tokens).max() > 1e-2  # not vacuous


def test_a_missing_weight_is_named(hf_model):
    weights = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    name = next(k for k in weights if k.endswith("encoder.layers.1.mlp.fc2.weight"))
    del weights[name]
    with pytest.raises(HFError, match=r"encoder\.layers\.1\.mlp\.fc2\.weight"):
        load_image_encoder(weights, siglip_from_hf(VISION), 64, 4)
    with pytest.raises(ValueError, match="mm_tokens_per_image=3 must be a square"):
        load_image_encoder(weights, siglip_from_hf(VISION), 64, 3)
