"""Gemma 3's image encoder and Hugging Face's names for it: the SigLIP tower
(`vision_tower.vision_model.*`) and the projector (`multi_modal_projector.*`) as ParamMaps
(the fused q/k/v projection, the patch convolution as a matmul over flat patches), used to load
and to export. Checkpoints name the tensors in several layouts (the Hub's; transformers 5's
modules, `model.vision_tower.*`; its exports, `vision_tower.*`): `canonical_name` maps each to
the Hub's, which these maps use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

from jaxtrain.errors import HFError
from jaxtrain.hf.weights import ParamMap, linear_map, same_map
from jaxtrain.models.gemma3_vision import Gemma3ImageEncoder
from jaxtrain.models.siglip import SiglipVisionConfig
from jaxtrain.pytrees import path_str

__all__ = [
    "apply_param_maps",
    "canonical_name",
    "image_encoder_param_maps",
    "load_image_encoder",
    "siglip_from_hf",
]

TOWER, PROJECTOR = "vision_tower.vision_model.", "multi_modal_projector."
# Other layouts' prefixes -> the Hub's (longest first: the first that matches wins).
_RENAMES = (
    ("model.vision_tower.vision_model.", TOWER),
    ("model.vision_tower.", TOWER),
    ("vision_tower.vision_model.", TOWER),
    ("vision_tower.", TOWER),
    ("model.multi_modal_projector.", PROJECTOR),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)


def canonical_name(name: str) -> str:
    """A Gemma 3 tensor's name as the Hub's checkpoints write it."""
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def siglip_from_hf(hf: Mapping[str, Any]) -> SiglipVisionConfig:
    """The tower's config from HF's `vision_config` (its fields by their HF names)."""
    fields = {f for f in SiglipVisionConfig.__dataclass_fields__ if f != "model_type"}
    return SiglipVisionConfig(**{k: v for k, v in hf.items() if k in fields})


def image_encoder_param_maps(
    vision: SiglipVisionConfig, text_hidden: int, path: str = ""
) -> list[ParamMap]:
    """A ParamMap per parameter of a Gemma3ImageEncoder (its paths under `path`)."""
    d, n, f = vision.hidden_size, vision.num_attention_heads, vision.intermediate_size
    h, c, p = d // n, vision.num_channels, vision.patch_size
    tower = f"{path}vision_tower/"
    maps = [
        ParamMap(
            f"{tower}patch_embed/kernel", (f"{TOWER}embeddings.patch_embedding.weight",),
            ((d, c, p, p),), lambda t: t[0].reshape(d, -1).T,
            lambda a: [a.T.reshape(d, c, p, p)],
        ),
        same_map(f"{tower}patch_embed/bias", f"{TOWER}embeddings.patch_embedding.bias", (d,)),
        same_map(f"{tower}position_embedding", f"{TOWER}embeddings.position_embedding.weight",
                 (vision.patches_per_side**2, d)),
    ]  # fmt: skip
    for i in range(vision.num_hidden_layers):
        ours, theirs = f"{tower}layers/{i}/", f"{TOWER}encoder.layers.{i}."
        for norm, hf_norm in (
            ("layernorm_before", "layer_norm1"),
            ("layernorm_after", "layer_norm2"),
        ):
            for w in ("weight", "bias"):
                maps.append(same_map(f"{ours}{norm}/{w}", f"{theirs}{hf_norm}.{w}", (d,)))
        qkv = tuple(f"{theirs}self_attn.{x}_proj" for x in "qkv")
        maps += [
            ParamMap(
                f"{ours}qkv/kernel", tuple(f"{q}.weight" for q in qkv), ((d, d),) * 3,
                lambda t: np.stack([w.T.reshape(d, n, h) for w in t], axis=1),
                lambda a: [a[:, i].reshape(d, d).T for i in range(3)],
            ),
            ParamMap(
                f"{ours}qkv/bias", tuple(f"{q}.bias" for q in qkv), ((d,),) * 3,
                lambda t: np.stack([b.reshape(n, h) for b in t]),
                lambda a: [a[i].reshape(d) for i in range(3)],
            ),
            ParamMap(
                f"{ours}out/kernel", (f"{theirs}self_attn.out_proj.weight",), ((d, d),),
                lambda t: t[0].T.reshape(n, h, d), lambda a: [a.reshape(d, d).T],
            ),
            same_map(f"{ours}out/bias", f"{theirs}self_attn.out_proj.bias", (d,)),
            linear_map(f"{ours}fc1/kernel", f"{theirs}mlp.fc1.weight", (f, d), (d, f)),
            same_map(f"{ours}fc1/bias", f"{theirs}mlp.fc1.bias", (f,)),
            linear_map(f"{ours}fc2/kernel", f"{theirs}mlp.fc2.weight", (d, f), (f, d)),
            same_map(f"{ours}fc2/bias", f"{theirs}mlp.fc2.bias", (d,)),
        ]  # fmt: skip
    for w in ("weight", "bias"):
        maps.append(same_map(f"{tower}post_layernorm/{w}", f"{TOWER}post_layernorm.{w}", (d,)))
    projector = f"{path}multi_modal_projector/"
    maps += [
        same_map(f"{projector}mm_soft_emb_norm/weight", f"{PROJECTOR}mm_soft_emb_norm.weight",
                 (d,)),
        same_map(f"{projector}mm_input_projection", f"{PROJECTOR}mm_input_projection_weight",
                 (d, text_hidden)),
    ]  # fmt: skip
    return maps


def apply_param_maps(
    module: nnx.Module, maps: list[ParamMap], weights: Mapping[str, Any], source: str
) -> None:
    """`module`'s parameters set from `weights` (any layout's names -> arrays) through
    `maps`; HFError naming a missing or misshapen tensor, or a parameter no map fills."""
    named = {canonical_name(k): v for k, v in weights.items()}
    params = {path_str(path): var for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    unmapped = sorted(set(params) - {m.path for m in maps})
    if unmapped:
        raise HFError(f"{source}: no weight map for {unmapped[:3]}: another architecture.")
    for spec in maps:
        arrays = []
        for name, shape in zip(spec.hf_names, spec.hf_shapes):
            if name not in named:
                raise HFError(f"{source}: the checkpoint has no {name!r} (nor any other "
                              "layout's name for it): incomplete, or another model.")  # fmt: skip
            array = np.asarray(named[name], np.float32)
            if array.shape != tuple(shape):
                raise HFError(f"{source}: {name!r} has shape {list(array.shape)}, the config "
                              f"implies {list(shape)}.")  # fmt: skip
            arrays.append(array)
        var = params[spec.path]
        var.set_value(spec.to_jax(arrays).astype(var.get_value().dtype))


def load_image_encoder(
    weights: Mapping[str, Any],
    vision: SiglipVisionConfig,
    text_hidden: int,
    mm_tokens_per_image: int,
    **kwargs: Any,
) -> Gemma3ImageEncoder:
    """A Gemma3ImageEncoder holding `weights` (HF names -> arrays); kwargs: dtypes."""
    encoder = Gemma3ImageEncoder(
        vision, text_hidden, mm_tokens_per_image, rngs=nnx.Rngs(0), **kwargs
    )
    maps = image_encoder_param_maps(vision, text_hidden)
    apply_param_maps(encoder, maps, weights, "the image encoder's weights")
    return encoder
