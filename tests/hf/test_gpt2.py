"""GPT-2: HF import and export with float32 logit parity against transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from hf_fixtures import forward, hf_gpt2, hf_logits, random_ids

from jaxtrain.hf import AutoModelForCausalLM, HFError, from_pretrained, save_pretrained
from jaxtrain.models import GPT2LMHeadModel, LlamaForCausalLM


def relative_error(ours, reference) -> float:
    return float(np.abs(np.asarray(ours) - reference).max() / np.abs(reference).max())


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    model = hf_gpt2()
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
    model = from_pretrained(path, model_class=GPT2LMHeadModel)
    out = save_pretrained(model, tmp_path / "export")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(reloaded, transformers.GPT2LMHeadModel)
    ids = random_ids((1, 16), seed=3)
    assert relative_error(forward(model, jnp.asarray(ids)), hf_logits(reloaded, ids)) < 2e-5


def test_wrong_class_and_unsupported_options_are_refused(gpt2_dir, tmp_path):
    path, _ = gpt2_dir
    with pytest.raises(HFError, match="GPT2LMHeadModel"):
        from_pretrained(path, model_class=LlamaForCausalLM)
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "reorder_and_upcast_attn": True}))
    with pytest.raises(HFError, match="reorder_and_upcast_attn"):
        AutoModelForCausalLM.from_pretrained(bad)
