"""Hugging Face mapping of Gemma 2 (``gemma2``) and Gemma 3 text (``gemma3_text``).

The weights are the Llama family's plus two norms per layer (pre/post feed-forward), so the
maps reuse jaxtrain.hf.weights (the multimodal ``gemma3`` reads its decoder through them:
hf/gemma3_vlm.py). What jaxtrain's Gemma does not implement is refused: bidirectional
attention, rope types other than default and linear (Gemma 3's global layers), another
activation, quantisation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.hf.errors import HFError
from jaxtrain.hf.weights import ParamMap, same_map
from jaxtrain.hf.weights import ignorable as llama_ignorable
from jaxtrain.hf.weights import param_maps as llama_param_maps
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.gemma import GemmaConfig

ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_COPIED = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
    "initializer_range", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id",
    "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "sliding_window", "layer_types",
)  # fmt: skip


def _rope(params: Any, field: str, fail) -> tuple[float, dict[str, Any] | None]:
    params = dict(params or {})
    theta = float(params.pop("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default" and not params:
        return theta, None
    if rope_type == "linear" and set(params) == {"factor"}:
        return theta, {"rope_type": "linear", "factor": params["factor"]}
    raise fail(field, f"rope {rope_type!r} with {sorted(params)}", "Use default or linear rope.")


def from_hf_gemma_config(hf: dict[str, Any], source: str = "config.json") -> GemmaConfig:
    def fail(field: str, problem: str, fix: str) -> HFError:
        return HFError(f"{source}: {field}: {problem} is not supported. {fix}")

    model_type = hf.get("model_type")
    if model_type == "gemma3":
        raise fail(
            "model_type",
            "'gemma3' (the multimodal Gemma 3 with a vision tower)",
            "jaxtrain loads the text-only gemma3_text (Gemma3ForCausalLM) checkpoints.",
        )
    if model_type not in ARCHITECTURES:
        raise fail("model_type", repr(model_type), f"Gemma types: {list(ARCHITECTURES)}.")
    if hf.get("quantization_config"):
        raise fail("quantization_config", "quantized weights", "Load unquantized weights.")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise fail("hidden_activation", repr(act), "Gemma uses gelu_pytorch_tanh.")
    if hf.get("use_bidirectional_attention"):
        raise fail("use_bidirectional_attention", "true", "jaxtrain's Gemma is causal.")
    if hf.get("attention_bias"):
        raise fail("attention_bias", "true", "Gemma has no attention bias.")
    values = {k: hf[k] for k in _COPIED if hf.get(k) is not None}
    values["model_type"] = model_type
    values["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", True))
    rope = hf.get("rope_parameters")
    if model_type == "gemma3_text":
        values["qk_norm"] = True
        if isinstance(rope, dict) and "full_attention" in rope:
            theta, scaling = _rope(rope["full_attention"], "rope_parameters.full_attention", fail)
            local, local_scaling = _rope(
                rope.get("sliding_attention"), "rope_parameters.sliding_attention", fail
            )
            if local_scaling is not None:
                raise fail("rope_parameters.sliding_attention", "rope scaling", "Remove it.")
        else:  # transformers 4: rope_theta, rope_scaling, rope_local_base_freq
            theta, scaling = _rope(
                {"rope_theta": hf.get("rope_theta", 1e6), **(hf.get("rope_scaling") or {})},
                "rope_scaling", fail,
            )  # fmt: skip
            local = float(hf.get("rope_local_base_freq", 10000.0))
        values["rope_local_base_freq"] = local
    else:
        params = rope if isinstance(rope, dict) else {
            "rope_theta": hf.get("rope_theta", 10000.0), **(hf.get("rope_scaling") or {})
        }  # fmt: skip
        theta, scaling = _rope(params, "rope_parameters", fail)
    values["rope_theta"], values["rope_scaling"] = theta, scaling
    try:
        return GemmaConfig(**values)
    except ValueError as err:
        raise HFError(f"{source}: {err}") from err


def to_hf_gemma_config(config: GemmaConfig, dtype: str = "float32") -> dict[str, Any]:
    if config.mlp_bias or config.attention_bias:
        raise HFError("cannot export Gemma with mlp_bias or attention_bias: HF Gemma has none.")
    full = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling:
        full.update(config.rope_scaling)
    out = {
        "architectures": [ARCHITECTURES[config.model_type]],
        "model_type": config.model_type,
        **{k: getattr(config, k) for k in _COPIED},
        "hidden_activation": config.hidden_act,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if config.model_type == "gemma3_text":
        local = config.rope_local_base_freq or config.rope_theta
        out["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": float(local)},
        }
        out["use_bidirectional_attention"] = False
    else:
        out["rope_parameters"] = full
    return out


def gemma_param_maps(config: GemmaConfig) -> list[ParamMap]:
    names = {f.name for f in dataclasses.fields(LlamaConfig)}
    twin = {k: v for k, v in config.to_dict().items() if k in names}
    twin.update(model_type="llama", hidden_act="silu")
    maps = []
    d = config.hidden_size
    for spec in llama_param_maps(LlamaConfig(**twin)):
        maps.append(spec)
        if spec.path.endswith("post_attention_layernorm/weight"):
            i = spec.path.split("/")[2]
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                maps.append(
                    same_map(
                        f"model/layers/{i}/{norm}/weight", f"model.layers.{i}.{norm}.weight", (d,)
                    )
                )
    return maps


def gemma_ignorable(name: str, config: GemmaConfig) -> bool:
    return llama_ignorable(name, config)
