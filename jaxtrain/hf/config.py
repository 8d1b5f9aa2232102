"""Hugging Face ``config.json`` <-> LlamaConfig for the llama, mistral, qwen2, qwen3 types.

Anything that would change the network and that jaxtrain does not implement (another
model_type, an unknown rope type, o_proj bias, mixed sliding/full layers, quantisation...)
raises HFError naming the field: never a silently different model. Fields that do not
change the forward pass (dropout rates, use_cache, ...) are ignored.
"""

from __future__ import annotations

from typing import Any

from jaxtrain.hf.errors import HFError
from jaxtrain.models.config import LlamaConfig

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_COPIED = (
    "num_key_value_heads",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
# Keys a rope dict may hold, per rope type (rope_theta/rope_type/type always allowed).
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}


def from_hf_config(hf: dict[str, Any], *, source: str = "config.json") -> LlamaConfig:
    """LlamaConfig equivalent to an HF config dict; HFError names what cannot be mapped."""

    def fail(field: str, problem: str, fix: str) -> HFError:
        return HFError(f"{source}: {field}: {problem}. {fix}")

    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise fail(
            "model_type",
            f"{model_type!r} is not supported",
            f"jaxtrain loads model_type {', '.join(ARCHITECTURES)} (Llama architecture family).",
        )
    if hf.get("quantization_config"):
        raise fail(
            "quantization_config",
            "quantized checkpoints are not supported",
            "Load the unquantized (float16/bfloat16/float32) weights.",
        )
    missing = [k for k in _REQUIRED if hf.get(k) is None]
    if missing:
        raise fail(", ".join(missing), "missing", "A Llama-family config.json must set them.")
    values: dict[str, Any] = {k: hf[k] for k in _REQUIRED}
    values.update({k: hf[k] for k in _COPIED if k in hf})
    if hf.get("head_dim") is not None:
        values["head_dim"] = hf["head_dim"]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise fail("hidden_act", f"{act!r} is not supported", "Only 'silu' (SwiGLU) is.")
    values["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    values["rope_theta"], values["rope_scaling"] = _rope(hf, fail)
    values["model_type"] = model_type

    attention_bias = bool(hf.get("attention_bias", False))
    if model_type in ("llama", "qwen3") and attention_bias:
        raise fail(
            "attention_bias",
            f"true means {model_type} also biases o_proj, which jaxtrain's attention lacks",
            "Only q/k/v biases (Qwen2 style) are supported.",
        )
    values["attention_bias"] = model_type == "qwen2"  # Qwen2 always biases q, k and v
    values["qk_norm"] = model_type == "qwen3"
    if model_type == "llama":
        values["mlp_bias"] = bool(hf.get("mlp_bias", False))
    elif hf.get("mlp_bias"):
        raise fail("mlp_bias", f"{model_type} has no MLP bias", "Remove it or set it false.")
    if model_type == "mistral":
        values["sliding_window"] = hf.get("sliding_window")
    elif model_type in ("qwen2", "qwen3"):
        values["sliding_window"] = _qwen_window(hf, fail)
    try:
        return LlamaConfig(**values)
    except ValueError as err:
        raise HFError(f"{source}: {err}") from err


def _rope(hf: dict[str, Any], fail) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers-5 ``rope_parameters`` or v4 keys."""
    if isinstance(hf.get("rope_parameters"), dict):
        field, params = "rope_parameters", dict(hf["rope_parameters"])
    else:
        field, params = "rope_scaling", dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in _ROPE_KEYS:
        raise fail(
            f"{field}.rope_type",
            f"{rope_type!r} is not supported",
            f"Supported rope types: {', '.join(_ROPE_KEYS)}.",
        )
    if params.get("partial_rotary_factor", 1.0) == 1.0:
        params.pop("partial_rotary_factor", None)
    unknown = sorted(set(params) - _ROPE_KEYS[rope_type])
    if unknown:
        raise fail(
            f"{field}.{unknown[0]}",
            f"not supported for rope type {rope_type!r}",
            f"Allowed keys: {sorted(_ROPE_KEYS[rope_type]) or 'none'}.",
        )
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **params}


def _qwen_window(hf: dict[str, Any], fail) -> int | None:
    n = hf["num_hidden_layers"]
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        use = bool(hf.get("use_sliding_window", False)) and window is not None
        first = hf.get("max_window_layers", n)
        layer_types = [
            "sliding_attention" if use and i >= first else "full_attention" for i in range(n)
        ]
    kinds = set(layer_types)
    if kinds <= {"full_attention"}:
        return None
    if kinds == {"sliding_attention"} and window is not None:
        return int(window)
    raise fail(
        "layer_types",
        f"{sorted(kinds)} (sliding window {window}) mixes attention kinds across layers",
        "jaxtrain applies one attention kind to every layer; use an all-full-attention config.",
    )


def to_hf_config(config: LlamaConfig, *, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` dict transformers reads back as the same network.

    Raises HFError when ``config`` has a feature the HF class of its model_type lacks.
    """
    mt = config.model_type

    def refuse(field: str, why: str) -> HFError:
        return HFError(
            f"cannot export model_type={mt!r}: {field}={getattr(config, field)!r} {why}. "
            "Change the config's model_type to a family that has it "
            "(llama: mlp_bias; mistral: sliding_window; qwen2: attention_bias; qwen3: qk_norm)."
        )

    wants = {
        "llama": {"attention_bias": False, "qk_norm": False},
        "mistral": {"attention_bias": False, "qk_norm": False, "mlp_bias": False},
        "qwen2": {"attention_bias": True, "qk_norm": False, "mlp_bias": False},
        "qwen3": {"attention_bias": False, "qk_norm": True, "mlp_bias": False},
    }[mt]
    for field, value in wants.items():
        if getattr(config, field) != value:
            raise refuse(field, f"is not expressible in HF {ARCHITECTURES[mt]}")
    if mt == "llama" and config.sliding_window is not None:
        raise refuse("sliding_window", "has no HF Llama equivalent")

    rope: dict[str, Any] = {"rope_theta": float(config.rope_theta), "rope_type": "default"}
    if config.rope_scaling is not None:
        rope.update(config.rope_scaling)
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[mt]],
        "model_type": mt,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps,
        # transformers >= 5 reads rope_parameters; older versions rope_theta/rope_scaling.
        "rope_parameters": rope,
        "rope_theta": float(config.rope_theta),
        "rope_scaling": dict(config.rope_scaling) if config.rope_scaling else None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if mt in ("llama", "qwen3"):
        out["attention_bias"] = False
    if mt == "llama":
        out["mlp_bias"] = config.mlp_bias
    if mt == "mistral":
        out["sliding_window"] = config.sliding_window
    if mt in ("qwen2", "qwen3"):
        sliding = config.sliding_window is not None
        out["sliding_window"] = config.sliding_window
        out["use_sliding_window"] = sliding
        out["max_window_layers"] = 0 if sliding else config.num_hidden_layers
        kind = "sliding_attention" if sliding else "full_attention"
        out["layer_types"] = [kind] * config.num_hidden_layers
    return out
