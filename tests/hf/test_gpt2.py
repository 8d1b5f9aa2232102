"""GPT-2: HF import and export with float32 logit parity against transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_fixtures import forward, hf_logits, random_ids

from jaxtrain.hf import HFError
from jaxtrain.models import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM


def relative_error(ours, reference) -> float:
    return float(np.abs(np.asarray(ours) - reference).max() / np.abs(reference).max())


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    config = transformers.GPT2Config(
        vocab_size=320, n_embd=32, n_layer=2, n_head=4, n_positions=64, initializer_range=0.2
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # random norms and biases: a mapping error on them must show
        for name, param in model.named_parameters():
            if name.endswith(".bias") or ".ln_" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.eval()
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return path, model


def test_logits_and_parameter_count_match_transformers(gpt2_dir):
    path, reference_model = gpt2_dir
    model = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(model, GPT2LMHeadModel)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_params == model.config.num_parameters() == reference_model.num_parameters()
    ids = random_ids((2, 24), seed=1)
    assert relative_error(forward(model, jnp.asarray(ids)), hf_logits(reference_model, ids)) < 2e-5


def test_export_reloads_in_transformers_with_same_logits(gpt2_dir, tmp_path):
    path, _ = gpt2_dir
    model = GPT2LMHeadModel.from_pretrained(path)
    out = model.save_pretrained(tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(reloaded, transformers.GPT2LMHeadModel)
    ids = random_ids((1, 16), seed=3)
    assert relative_error(forward(model, jnp.asarray(ids)), hf_logits(reloaded, ids)) < 2e-5


def test_wrong_class_and_unsupported_options_are_refused(gpt2_dir, tmp_path):
    path, _ = gpt2_dir
    with pytest.raises(HFError, match="GPT2LMHeadModel"):
        LlamaForCausalLM.from_pretrained(path)
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "reorder_and_upcast_attn": True}))
    with pytest.raises(HFError, match="reorder_and_upcast_attn"):
        AutoModelForCausalLM.from_pretrained(bad)
