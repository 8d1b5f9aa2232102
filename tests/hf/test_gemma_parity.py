"""Gemma 2 and Gemma 3 (text): transformers checkpoints load with the same logits and
parameter counts, jaxtrain exports load in transformers, unsupported variants are refused."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from hf_fixtures import GEMMA_CASES as CASES
from hf_fixtures import forward, hf_logits, hf_model, random_ids

from jaxtrain.hf import AutoModelForCausalLM, HFError, save_pretrained
from jaxtrain.models.gemma import GemmaConfig, GemmaForCausalLM


def relative_error(ours, reference) -> float:
    return float(np.abs(np.asarray(ours) - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize("name", sorted(CASES))
def test_gemma_checkpoints_match_transformers_both_ways(name, tmp_path):
    reference_model = hf_model(CASES[name]())
    reference_model.save_pretrained(tmp_path / "hf")
    ids = random_ids((2, 24), seed=1)
    reference = hf_logits(reference_model, ids)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert isinstance(model, GemmaForCausalLM) and model.config.model_type == name
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_params == model.config.num_parameters() == reference_model.num_parameters()
    logits = forward(model, jnp.asarray(ids))
    assert relative_error(logits, reference) < 2e-5
    if name == "gemma2":  # the final soft-cap bounds the logits
        assert float(jnp.abs(logits).max()) < 3.0

    save_pretrained(model, tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager"
    ).eval()
    assert type(exported) is type(reference_model)
    assert relative_error(hf_logits(exported, ids), reference) < 2e-5
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "export").config == model.config


def test_gemma_features_are_really_exercised(tmp_path):
    """Switching off soft-capping or the sliding window changes the Gemma 2 logits."""
    hf_model(CASES["gemma2"]()).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = jnp.asarray(random_ids((1, 16), seed=2))
    base = np.asarray(forward(model, ids))
    params = nnx.state(model, nnx.Param)
    for change in (
        {"attn_logit_softcapping": None},
        {"final_logit_softcapping": None},
        {"layer_types": ["full_attention"] * 3},
    ):
        config = GemmaConfig.from_dict({**model.config.to_dict(), **change})
        other = nnx.merge(nnx.graphdef(GemmaForCausalLM(config, rngs=nnx.Rngs(0))), params)
        assert relative_error(forward(other, ids), base) > 1e-4, change


def test_unsupported_gemma_variants_are_refused(tmp_path):
    hf_model(CASES["gemma3_text"]()).save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    for change, field in [
        # The multimodal family's (hf/gemma3_vlm.py): a text-only config is not one.
        ({"model_type": "gemma3"}, "text_config is missing"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (
            {
                "rope_parameters": {
                    **hf["rope_parameters"],
                    "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
                }
            },
            "rope_parameters",
        ),  # fmt: skip
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**hf, **change}))
        with pytest.raises(HFError, match=field):
            AutoModelForCausalLM.from_pretrained(tmp_path)
