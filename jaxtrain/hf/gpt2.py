"""GPT-2 <-> Hugging Face: config.json mapping and weight maps (GPT2LMHeadModel).

HF GPT-2 stores its projections as ``Conv1D`` weights, already input-major ([in, out]), so
they map onto jaxtrain kernels by a reshape, with no transpose; c_attn's [d, 3d] output is
q | k | v, each heads-major.
"""

from __future__ import annotations

from typing import Any

from jaxtrain.hf.errors import HFError
from jaxtrain.hf.weights import ParamMap
from jaxtrain.models.auto import ModelFamily
from jaxtrain.models.blocks import GELU_ACTS
from jaxtrain.models.gpt2 import GPT2Config, GPT2LMHeadModel

# HF name -> ours, for the fields that change nothing but their name.
_RENAMED = {
    "vocab_size": "vocab_size",
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_inner": "intermediate_size",
    "n_positions": "max_position_embeddings",
    "activation_function": "hidden_act",
    "layer_norm_epsilon": "layer_norm_epsilon",
    "initializer_range": "initializer_range",
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "pad_token_id": "pad_token_id",
}
# Options that change the network, with the only value jaxtrain implements.
_FIXED = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}


def gpt2_from_hf(hf: dict[str, Any], source: str = "config.json") -> GPT2Config:
    """GPT2Config from an HF GPT-2 config dict; HFError names what cannot be mapped."""
    for field, wanted in _FIXED.items():
        if field in hf and hf[field] is not None and hf[field] != wanted:
            raise HFError(
                f"{source}: {field}: {hf[field]!r} is not supported. jaxtrain's GPT-2 "
                f"implements {field}={wanted!r} only."
            )
    act = hf.get("activation_function", "gelu_new")
    if act not in GELU_ACTS:
        raise HFError(
            f"{source}: activation_function: {act!r} is not supported; use one of "
            f"{sorted(GELU_ACTS)}."
        )
    if hf.get("quantization_config"):
        raise HFError(f"{source}: quantization_config: quantized checkpoints are not supported.")
    values = {ours: hf[name] for name, ours in _RENAMED.items() if name in hf}
    try:
        return GPT2Config(**values)
    except (TypeError, ValueError) as err:
        raise HFError(f"{source}: {err}") from err


def gpt2_to_hf(config: GPT2Config, dtype: str = "float32") -> dict[str, Any]:
    """The config.json dict transformers reads back as the same GPT-2."""
    out: dict[str, Any] = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    c = config.to_dict()
    out.update({name: c[ours] for name, ours in _RENAMED.items()})
    out.update(_FIXED)
    out.update(
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=True, dtype=dtype,
        torch_dtype=dtype,
    )  # fmt: skip
    return out


def _same(path: str, name: str, shape: tuple[int, ...], ours: tuple[int, ...] | None = None):
    ours = ours or shape
    return ParamMap(
        path, (name,), (shape,), lambda t: t[0].reshape(ours), lambda a: [a.reshape(shape)]
    )


def gpt2_param_maps(config: GPT2Config) -> list[ParamMap]:
    """Every parameter of GPT2LMHeadModel(config), in HF checkpoint order."""
    c = config
    d, f, n, h = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.head_dim
    maps = [
        _same("transformer/wte/embedding", "transformer.wte.weight", (c.vocab_size, d)),
        _same("transformer/wpe", "transformer.wpe.weight", (c.max_position_embeddings, d)),
    ]
    for i in range(c.num_hidden_layers):
        ours, hf = f"transformer/h/{i}", f"transformer.h.{i}"
        for norm in ("ln_1", "ln_2"):
            for p in ("weight", "bias"):
                maps.append(_same(f"{ours}/{norm}/{p}", f"{hf}.{norm}.{p}", (d,)))
        maps += [
            _same(
                f"{ours}/attn/c_attn/kernel", f"{hf}.attn.c_attn.weight", (d, 3 * d), (d, 3, n, h)
            ),
            _same(f"{ours}/attn/c_attn/bias", f"{hf}.attn.c_attn.bias", (3 * d,), (3, n, h)),
            _same(f"{ours}/attn/c_proj/kernel", f"{hf}.attn.c_proj.weight", (d, d), (n, h, d)),
            _same(f"{ours}/attn/c_proj/bias", f"{hf}.attn.c_proj.bias", (d,)),
            _same(f"{ours}/mlp/c_fc/kernel", f"{hf}.mlp.c_fc.weight", (d, f)),
            _same(f"{ours}/mlp/c_fc/bias", f"{hf}.mlp.c_fc.bias", (f,)),
            _same(f"{ours}/mlp/c_proj/kernel", f"{hf}.mlp.c_proj.weight", (f, d)),
            _same(f"{ours}/mlp/c_proj/bias", f"{hf}.mlp.c_proj.bias", (d,)),
        ]
    for p in ("weight", "bias"):
        maps.append(_same(f"transformer/ln_f/{p}", f"transformer.ln_f.{p}", (d,)))
    return maps


def gpt2_ignorable(name: str, config: GPT2Config) -> bool:
    """The tied lm_head copy and old checkpoints' causal-mask buffers carry no weights."""
    return name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias"))


GPT2 = ModelFamily(
    name="gpt2",
    model_types=("gpt2",),
    model_class=GPT2LMHeadModel,
    from_hf_config=gpt2_from_hf,
    to_hf_config=gpt2_to_hf,
    param_maps=gpt2_param_maps,
    ignorable=gpt2_ignorable,
)

__all__ = ["GPT2", "gpt2_from_hf", "gpt2_param_maps", "gpt2_to_hf"]
