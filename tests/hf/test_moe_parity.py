"""Mixtral, Qwen2-MoE and Qwen3-MoE: transformers checkpoints load with the same logits and
parameter counts, and jaxtrain exports load in transformers with the same logits."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from hf_fixtures import BASE, forward, hf_logits, hf_model, random_ids
from test_generate_parity import NEW, hf_greedy

from jaxtrain.hf import AutoModelForCausalLM, HFError, save_pretrained
from jaxtrain.models import generate
from jaxtrain.models.kv_cache import supports_kv_cache
from jaxtrain.models.moe import MoeConfig, MoeForCausalLM

MOE = dict(num_experts_per_tok=2)
CASES = {
    "mixtral": lambda: transformers.MixtralConfig(**BASE, **MOE, num_local_experts=4),
    # A dense layer (mlp_only_layers), a gated shared expert, q/k/v bias, top-k not renormalised.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **BASE,
        **MOE,
        num_experts=4,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        mlp_only_layers=[1],
    ),  # fmt: skip
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **BASE, **MOE, num_experts=4, moe_intermediate_size=16, head_dim=8, norm_topk_prob=True
    ),
}


def relative_error(ours, reference) -> float:
    return float(np.abs(np.asarray(ours) - reference).max() / np.abs(reference).max())


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_checkpoints_match_transformers_both_ways(name, tmp_path):
    reference_model = hf_model(CASES[name]())
    reference_model.save_pretrained(tmp_path / "hf")
    ids = random_ids((2, 24), seed=1)
    reference = hf_logits(reference_model, ids)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert isinstance(model, MoeForCausalLM) and model.config.model_type == name
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_params == model.config.num_parameters() == reference_model.num_parameters()
    assert relative_error(forward(model, jnp.asarray(ids)), reference) < 2e-5

    save_pretrained(model, tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager"
    ).eval()
    assert type(exported) is type(reference_model)
    assert relative_error(hf_logits(exported, ids), reference) < 2e-5
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert again.config == model.config


def test_routing_options_are_really_exercised(tmp_path):
    """Each routing feature of the Qwen2-MoE case changes the logits when switched off."""
    reference_model = hf_model(CASES["qwen2_moe"]())
    reference_model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = jnp.asarray(random_ids((1, 16), seed=2))
    base = np.asarray(forward(model, ids))
    params = nnx.state(model, nnx.Param)
    for change in ({"norm_topk_prob": True}, {"num_experts_per_tok": 1}):
        config = MoeConfig.from_dict({**model.config.to_dict(), **change})
        other = nnx.merge(nnx.graphdef(MoeForCausalLM(config, rngs=nnx.Rngs(0))), params)
        assert relative_error(forward(other, ids), base) > 1e-3, change


def test_unsupported_moe_configs_are_refused(tmp_path):
    config = CASES["mixtral"]()
    config.router_jitter_noise = 0.1
    hf_model(config).save_pretrained(tmp_path)
    with pytest.raises(HFError, match="router_jitter_noise"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "router_jitter_noise": 0.0}))
    AutoModelForCausalLM.from_pretrained(tmp_path)  # the same weights load without noise
    shared = MoeConfig(model_type="mixtral", shared_expert_intermediate_size=8, num_hidden_layers=1,
                       hidden_size=32, intermediate_size=32, num_attention_heads=4, vocab_size=64)  # fmt: skip
    with pytest.raises(HFError, match="shared expert"):
        save_pretrained(MoeForCausalLM(shared, rngs=nnx.Rngs(0)), tmp_path / "out")


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_cached_greedy_generation_equals_transformers(name, tmp_path):
    reference_model = hf_model(CASES[name]())
    reference_model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert supports_kv_cache(model)
    prompts = random_ids((2, 9), seed=4)
    want = hf_greedy(reference_model, prompts)
    np.testing.assert_array_equal(generate(model, prompts, max_new_tokens=NEW), want)


def test_a_qwen2_moe_without_qkv_bias_round_trips(tmp_path):
    """transformers' Qwen2-MoE may leave q/k/v unbiased (qkv_bias=False): such a model
    loaded, trained, then failed to export ("no parameter .../qkv_proj/bias")."""
    reference_model = hf_model(transformers.Qwen2MoeConfig(
        **BASE, **MOE, num_experts=4, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, qkv_bias=False,
    ))  # fmt: skip
    reference_model.save_pretrained(tmp_path / "hf")
    ids = random_ids((2, 16), seed=3)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not model.config.attention_bias
    save_pretrained(model, tmp_path / "export")
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager"
    ).eval()
    assert not exported.config.qkv_bias
    reference = hf_logits(reference_model, ids)
    assert relative_error(hf_logits(exported, ids), reference) < 2e-5


def test_what_transformers_cannot_hold_is_refused_or_said(tmp_path, caplog):
    """A qwen3_moe without q/k norms failed as "cannot export model_type='qwen3'"; a
    qwen2_moe without a shared expert exported what the loader refuses; a capacity_factor
    was dropped in silence (transformers' MoE models are dropless)."""
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=4, num_experts=4)  # fmt: skip
    for config, match in [
        (MoeConfig(model_type="qwen3_moe", **small), "qwen3_moe' without qk_norm"),
        (MoeConfig(model_type="qwen2_moe", attention_bias=True, **small), "without a shared"),
    ]:
        with pytest.raises(HFError, match=match):
            save_pretrained(MoeForCausalLM(config, rngs=nnx.Rngs(0)), tmp_path / "out")
    capped = MoeConfig(model_type="mixtral", capacity_factor=0.5, **small)
    with caplog.at_level("WARNING", logger="jaxtrain.hf"):
        save_pretrained(MoeForCausalLM(capped, rngs=nnx.Rngs(0)), tmp_path / "capped")
    assert "capacity_factor=0.5" in caplog.text and "routes every token" in caplog.text
