"""ViT: HF ViTForImageClassification import and export with float32 logit parity."""

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_fixtures import save_hf

from jaxtrain.hf import (
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    HFError,
    from_pretrained,
    save_pretrained,
)
from jaxtrain.models.vit import ViTForImageClassification


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=48, num_labels=5, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(config)
    with torch.no_grad():  # random norms, biases and embeddings show mapping errors
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "layernorm" in name or "token" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.eval()
    path = tmp_path_factory.mktemp("vit")
    model.save_pretrained(path)
    return path, model


def _logits(model, pixels):
    with torch.no_grad():
        return model(torch.as_tensor(pixels)).logits.numpy()


def test_logits_and_parameter_count_match_transformers(vit_dir, tmp_path):
    path, reference = vit_dir
    model = from_pretrained(path, model_class=ViTForImageClassification)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_params == model.config.num_parameters() == reference.num_parameters()
    pixels = np.random.RandomState(0).randn(3, 3, 16, 16).astype(np.float32)
    expected = _logits(reference, pixels)
    ours = np.asarray(model(pixels))
    assert np.abs(ours - expected).max() / np.abs(expected).max() < 2e-5
    # Export: transformers reads it back as the same classifier.
    out = save_pretrained(model, tmp_path / "export")
    reloaded = transformers.ViTForImageClassification.from_pretrained(out).eval()
    np.testing.assert_allclose(
        _logits(reloaded, pixels), expected, atol=2e-5 * np.abs(expected).max()
    )


def test_a_classifier_is_not_a_causal_lm(vit_dir):
    with pytest.raises(HFError, match="image-classification.*AutoModelForImageClassification"):
        AutoModelForCausalLM.from_pretrained(vit_dir[0])


def test_auto_model_for_image_classification_loads_the_vit(vit_dir):
    path, reference = vit_dir
    model = AutoModelForImageClassification.from_pretrained(path)
    assert isinstance(model, ViTForImageClassification)
    pixels = np.random.RandomState(1).randn(2, 3, 16, 16).astype(np.float32)
    expected = _logits(reference, pixels)
    assert np.abs(np.asarray(model(pixels)) - expected).max() / np.abs(expected).max() < 2e-5
    with pytest.raises(TypeError, match="from_pretrained"):
        AutoModelForImageClassification()


def test_a_causal_lm_is_not_an_image_classifier(tmp_path):
    save_hf("llama", tmp_path)
    with pytest.raises(HFError, match="'llama' is a causal-lm model.*AutoModelForCausalLM"):
        AutoModelForImageClassification.from_pretrained(tmp_path)
