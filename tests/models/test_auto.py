"""The model-family registry behind AutoModelForCausalLM and save_pretrained."""

import json

import pytest

from jaxtrain.hf import HFError
from jaxtrain.models import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxtrain.models.auto import (
    ModelFamily,
    family_of,
    get_family,
    register_family,
    supported_model_types,
)


def test_unknown_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(HFError, match="'bert' is not supported") as info:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        assert model_type in str(info.value)
    assert "config.json" in str(info.value)


def test_llama_types_resolve_to_the_llama_family():
    for model_type in ("llama", "mistral", "qwen2", "qwen3"):
        family = get_family(model_type)
        assert family.model_class is LlamaForCausalLM
        assert model_type in supported_model_types("causal-lm")
    assert family_of(LlamaConfig(model_type="qwen2")).name == "llama"


def test_register_family_refuses_to_shadow_without_replace():
    llama = get_family("llama")
    clash = ModelFamily(
        name="other",
        model_types=("llama",),
        model_class=LlamaForCausalLM,
        from_hf_config=llama.from_hf_config,
        to_hf_config=llama.to_hf_config,
        param_maps=llama.param_maps,
    )
    with pytest.raises(ValueError, match="already registered"):
        register_family(clash)
    assert get_family("llama") is llama
    with pytest.raises(ValueError, match="task"):
        ModelFamily("x", ("x",), LlamaForCausalLM, None, None, None, task="speech")
