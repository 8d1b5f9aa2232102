"""Bad Hugging Face input fails with an error naming the file, field or tensor."""

import json

import numpy as np
import pytest
from hf_fixtures import save_hf

from jaxtrain.hf import HFError, from_hf_config
from jaxtrain.hf.safetensors_io import SafetensorsFile, write_safetensors
from jaxtrain.models import AutoModelForCausalLM, LlamaForCausalLM


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf("llama", path)
    return path


def copy_with(src, dst, *, drop=(), replace=None, config=None):
    """A copy of an HF directory with tensors dropped/replaced or config.json edited."""
    dst.mkdir()
    shard = SafetensorsFile(src / "model.safetensors")
    tensors = {n: np.array(shard.get(n)) for n in shard.names if n not in drop}
    tensors.update(replace or {})
    write_safetensors(dst / "model.safetensors", tensors)
    hf = json.loads((src / "config.json").read_text())
    hf.update(config or {})
    (dst / "config.json").write_text(json.dumps(hf))
    return dst


def test_missing_tensor_names_tensor_and_file(llama_dir, tmp_path):
    bad = copy_with(llama_dir, tmp_path / "m", drop=["model.layers.1.mlp.up_proj.weight"])
    with pytest.raises(
        HFError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing.*model\.safetensors"
    ):
        LlamaForCausalLM.from_pretrained(bad)


def test_shape_mismatch_names_tensor_and_both_shapes(llama_dir, tmp_path):
    wrong = {"model.layers.0.self_attn.k_proj.weight": np.zeros((8, 32), np.float32)}
    bad = copy_with(llama_dir, tmp_path / "m", replace=wrong)
    with pytest.raises(HFError, match=r"k_proj\.weight.*\[8, 32\].*\[16, 32\]"):
        LlamaForCausalLM.from_pretrained(bad)


def test_tensors_the_config_has_no_place_for_are_an_error(llama_dir, tmp_path):
    # An o_proj bias would be silently dropped: config.json does not describe these weights.
    extra = {"model.layers.0.self_attn.o_proj.bias": np.zeros((32,), np.float32)}
    bad = copy_with(llama_dir, tmp_path / "m", replace=extra)
    with pytest.raises(HFError, match=r"o_proj\.bias"):
        LlamaForCausalLM.from_pretrained(bad)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "bert"}, "model_type"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters.rope_type"),
        (
            {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
            "rope_scaling.rope_type",
        ),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_config_names_the_field(llama_dir, tmp_path, change, field):
    bad = copy_with(llama_dir, tmp_path / "m", config=change)
    with pytest.raises(HFError, match=field.replace(".", r"\.")) as info:
        AutoModelForCausalLM.from_pretrained(bad)
    assert "config.json" in str(info.value)


def test_qwen_layers_mixing_sliding_and_full_attention_are_refused():
    hf = dict(model_type="qwen2", vocab_size=8, hidden_size=8, intermediate_size=8,
              num_hidden_layers=2, num_attention_heads=2, use_sliding_window=True,
              sliding_window=4, max_window_layers=1)  # fmt: skip
    with pytest.raises(HFError, match="layer_types"):
        from_hf_config(hf)
    assert from_hf_config({**hf, "max_window_layers": 0}).sliding_window == 4
    assert from_hf_config({**hf, "use_sliding_window": False}).sliding_window is None


def test_hub_id_without_local_copy_says_no_downloads(tmp_path):
    with pytest.raises(HFError, match="does not download") as info:
        AutoModelForCausalLM.from_pretrained("jaxtrain-tests/no-such-model")
    assert "local" in str(info.value)
    with pytest.raises(HFError, match="no such directory"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "nowhere" / "model"))


def test_directory_problems(llama_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFError, match="no config.json"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "empty")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((llama_dir / "config.json").read_text())
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(HFError, match=r"pytorch_model\.bin.*safetensors"):
        AutoModelForCausalLM.from_pretrained(no_weights)
    # An index that points at a shard that is not there.
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (no_weights / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFError, match=r"model-00002-of-00002\.safetensors.*missing"):
        AutoModelForCausalLM.from_pretrained(no_weights)
