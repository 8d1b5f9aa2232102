"""Qwen2.5-VL (`qwen2_5_vl`, Qwen2_5_VLForConditionalGeneration) and Hugging Face: its config
both ways (the Hub's flat config.json, text fields at the top, and transformers 5's nested
`text_config`), and its tensors: the decoder's through the Llama family's maps (a qwen2
decoder), the vision tower's here. Checkpoints name the tensors in two layouts, the Hub's
(`model.layers.*`, `visual.*`, `lm_head.*`) and transformers 5's modules
(`model.language_model.*`, `model.visual.*`); `canonical_name` maps both to the Hub's, which
the maps use and exports write."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

from jaxtrain.hf.config import from_hf_config, to_hf_config
from jaxtrain.hf.errors import HFError
from jaxtrain.hf.registry import ModelFamily
from jaxtrain.hf.weights import ParamMap, ignorable, linear_map, param_maps, same_map
from jaxtrain.models.qwen25_vl import Qwen25VLConfig, Qwen25VLForConditionalGeneration
from jaxtrain.models.qwen25_vl_vision import Qwen25VisionConfig
from jaxtrain.pytrees import path_str

__all__ = [
    "QWEN25_VL",
    "canonical_name",
    "from_hf_qwen25_vl_config",
    "load_qwen25_vl",
    "qwen25_vl_param_maps",
    "to_hf_qwen25_vl_config",
    "vision_param_maps",
]

# transformers 5's module prefixes -> the Hub's (the first that matches wins).
_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))
_VISION_FIELDS = {f for f in Qwen25VisionConfig.__dataclass_fields__ if f != "model_type"}
_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def canonical_name(name: str) -> str:
    """A Qwen2.5-VL tensor's name as the Hub's checkpoints write it."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _split_mrope(text: dict[str, Any], source: str) -> tuple[dict[str, Any], list[int]]:
    """(the text fields with a plain rope dict, mrope_section): M-RoPE's split is not a rope
    type of the Llama family, the frequencies it splits are the default ones."""
    field = "rope_parameters" if isinstance(text.get("rope_parameters"), Mapping) else None
    field = field or ("rope_scaling" if isinstance(text.get("rope_scaling"), Mapping) else None)
    rope = dict(text[field]) if field else {}
    section = rope.pop("mrope_section", None)
    if section is None:
        raise HFError(f"{source}: rope_parameters.mrope_section is missing (M-RoPE's split).")
    for key in ("type", "rope_type"):
        if rope.get(key) == "mrope":
            rope[key] = "default"
    plain = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling")}
    return {**plain, "rope_parameters": rope}, [int(s) for s in section]


def from_hf_qwen25_vl_config(hf: Mapping[str, Any], source: str = "config.json") -> Qwen25VLConfig:
    if hf.get("model_type") != "qwen2_5_vl":
        raise HFError(f"{source}: model_type {hf.get('model_type')!r} is not 'qwen2_5_vl'.")
    if not isinstance(hf.get("vision_config"), Mapping):
        raise HFError(f"{source}: vision_config is missing: not a Qwen2.5-VL checkpoint.")
    nested = hf.get("text_config")
    # The Hub's configs hold the text fields at the top; transformers 5 nests them.
    text = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
    text.update(dict(nested) if isinstance(nested, Mapping) else {})
    text, section = _split_mrope(text, source)
    tied = bool(hf.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    text = {**text, "model_type": "qwen2", "tie_word_embeddings": tied}
    decoder = from_hf_config(text, source=f"{source} text_config")
    vision = dict(hf["vision_config"])
    theta = (vision.get("rope_parameters") or {}).get("rope_theta", vision.get("rope_theta"))
    vision = {k: v for k, v in vision.items() if k in _VISION_FIELDS}
    try:
        return Qwen25VLConfig(
            text=decoder,
            vision=Qwen25VisionConfig(**vision, **({} if theta is None else {"rope_theta": theta})),
            mrope_section=tuple(section),
            **{k: int(hf[k]) for k in _TOKENS if hf.get(k) is not None},
        )
    except (TypeError, ValueError) as err:
        raise HFError(f"{source}: {err}") from None


def to_hf_qwen25_vl_config(config: Qwen25VLConfig, dtype: str = "float32") -> dict[str, Any]:
    text = to_hf_config(config.text, dtype=dtype)
    rope = {**text["rope_parameters"], "mrope_section": list(config.mrope_section)}
    drop = ("architectures", "rope_scaling", "tie_word_embeddings", "torch_dtype")
    text = {k: v for k, v in text.items() if k not in drop}
    text.update(model_type="qwen2_5_vl_text", rope_parameters=rope)
    vision = {k: v for k, v in config.vision.to_dict().items() if k != "rope_theta"}
    axial = {"rope_type": "axial", "rope_theta": config.vision.rope_theta}
    vision.update(model_type="qwen2_5_vl_vision", rope_parameters=axial)
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "text_config": text,
        "vision_config": vision,
        **{k: getattr(config, k) for k in _TOKENS},
        "tie_word_embeddings": config.text.tie_word_embeddings,
        "bos_token_id": config.text.bos_token_id,
        "eos_token_id": config.text.eos_token_id,
        "pad_token_id": config.text.pad_token_id,
        "dtype": dtype,
    }


def vision_param_maps(vision: Qwen25VisionConfig, path: str = "visual/") -> list[ParamMap]:
    """A ParamMap per parameter of the vision tower (its paths under `path`), Hub names."""
    d, f, n, h = vision.hidden_size, vision.intermediate_size, vision.num_heads, vision.head_dim
    c, t, p = vision.in_channels, vision.temporal_patch_size, vision.patch_size
    wide, out = d * vision.spatial_merge_size**2, vision.out_hidden_size
    maps = [
        # The Conv3d's weight [D, C, T, P, P] as a matmul over the processor's flat patches.
        ParamMap(f"{path}patch_embed/kernel", ("visual.patch_embed.proj.weight",),
                 ((d, c, t, p, p),), lambda w: w[0].reshape(d, -1).T,
                 lambda a: [a.T.reshape(d, c, t, p, p)]),
    ]  # fmt: skip
    for i in range(vision.depth):
        ours, theirs = f"{path}blocks/{i}/", f"visual.blocks.{i}."
        maps += [
            same_map(f"{ours}norm1/weight", f"{theirs}norm1.weight", (d,)),
            same_map(f"{ours}norm2/weight", f"{theirs}norm2.weight", (d,)),
            # HF splits qkv's 3 * D outputs as (q|k|v, head, head_dim).
            linear_map(f"{ours}qkv/kernel", f"{theirs}attn.qkv.weight", (3 * d, d), (d, 3, n, h)),
            ParamMap(f"{ours}qkv/bias", (f"{theirs}attn.qkv.bias",), ((3 * d,),),
                     lambda b: b[0].reshape(3, n, h), lambda a: [a.reshape(-1)]),
            linear_map(f"{ours}proj/kernel", f"{theirs}attn.proj.weight", (d, d), (n, h, d)),
            same_map(f"{ours}proj/bias", f"{theirs}attn.proj.bias", (d,)),
        ]  # fmt: skip
        for name, out_in in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            maps += [
                linear_map(f"{ours}{name}/kernel", f"{theirs}mlp.{name}.weight", out_in,
                           out_in[::-1]),
                same_map(f"{ours}{name}/bias", f"{theirs}mlp.{name}.bias", (out_in[0],)),
            ]  # fmt: skip
    merger = f"{path}merger/"
    return maps + [
        same_map(f"{merger}ln_q/weight", "visual.merger.ln_q.weight", (d,)),
        linear_map(f"{merger}fc1/kernel", "visual.merger.mlp.0.weight", (wide, wide), (wide, wide)),
        same_map(f"{merger}fc1/bias", "visual.merger.mlp.0.bias", (wide,)),
        linear_map(f"{merger}fc2/kernel", "visual.merger.mlp.2.weight", (out, wide), (wide, out)),
        same_map(f"{merger}fc2/bias", "visual.merger.mlp.2.bias", (out,)),
    ]


def qwen25_vl_param_maps(config: Qwen25VLConfig) -> list[ParamMap]:
    """A ParamMap per parameter of Qwen25VLForConditionalGeneration, by the Hub's names: the
    decoder's are a qwen2 LlamaForCausalLM's (same paths, same names)."""
    return param_maps(config.text) + vision_param_maps(config.vision)


def load_qwen25_vl(
    hf_config: Mapping[str, Any], weights: Mapping[str, Any], source: str = "config.json", **kw: Any
) -> Qwen25VLForConditionalGeneration:
    """The model of a `qwen2_5_vl` config.json (a dict) holding `weights` (HF names of either
    layout -> arrays); kw: dtypes. HFError naming a missing or misshapen tensor."""
    config = from_hf_qwen25_vl_config(hf_config, source)
    model = Qwen25VLForConditionalGeneration(config, rngs=nnx.Rngs(0), **kw)
    named = {canonical_name(k): v for k, v in weights.items()}
    params = {path_str(path): var for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for spec in qwen25_vl_param_maps(config):
        arrays = []
        for name, shape in zip(spec.hf_names, spec.hf_shapes):
            if name not in named:
                raise HFError(f"{source}: the checkpoint has no {name!r} (in either layout).")
            array = np.asarray(named[name], np.float32)
            if array.shape != tuple(shape):
                raise HFError(f"{source}: {name!r} has shape {list(array.shape)}, the config "
                              f"implies {list(shape)}.")  # fmt: skip
            arrays.append(array)
        var = params.pop(spec.path)
        var.set_value(spec.to_jax(arrays).astype(var.get_value().dtype))
    if params:
        raise HFError(f"{source}: no weight map for {sorted(params)[:3]}: another architecture.")
    return model


def qwen25_vl_ignorable(name: str, config: Qwen25VLConfig) -> bool:
    """A tied output head's copy and rotary buffers carry no weights of their own."""
    return ignorable(canonical_name(name), config.text)


QWEN25_VL = ModelFamily(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    model_class=Qwen25VLForConditionalGeneration,
    from_hf_config=from_hf_qwen25_vl_config,
    to_hf_config=to_hf_qwen25_vl_config,
    param_maps=qwen25_vl_param_maps,
    ignorable=qwen25_vl_ignorable,
    canonical_name=canonical_name,
)
