"""Gemma 3's image encoder from a Hugging Face Gemma3ForConditionalGeneration's weights: the
SigLIP tower (`vision_tower.vision_model.*`) and the projector (`multi_modal_projector.*`),
each tensor renamed and laid out as jaxtrain's modules hold it (the fused q/k/v projection,
the patch convolution as a matmul over flat patches)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

from jaxtrain.errors import HFError
from jaxtrain.models.gemma3_vision import Gemma3ImageEncoder
from jaxtrain.models.siglip import SiglipVisionConfig

__all__ = ["fill_image_encoder", "load_image_encoder", "siglip_from_hf"]

# Where each part's tensors live: Hub checkpoints name the tower's `vision_tower.vision_model.`,
# transformers 5's modules `model.vision_tower.` (its loader renames on the way in).
TOWER = ("vision_tower.vision_model.", "model.vision_tower.vision_model.",
         "model.vision_tower.", "vision_tower.")  # fmt: skip
LANGUAGE = ("language_model.model.", "model.language_model.")  # the decoder's, both ways
PROJECTOR = ("multi_modal_projector.", "model.multi_modal_projector.")


def siglip_from_hf(hf: Mapping[str, Any]) -> SiglipVisionConfig:
    """The tower's config from HF's `vision_config` (its fields by their HF names)."""
    fields = {f for f in SiglipVisionConfig.__dataclass_fields__ if f != "model_type"}
    return SiglipVisionConfig(**{k: v for k, v in hf.items() if k in fields})


def _take(weights: Mapping[str, Any], prefixes: tuple[str, ...], name: str) -> np.ndarray:
    for prefix in prefixes:
        if prefix + name in weights:
            return np.asarray(weights[prefix + name], np.float32)
    raise HFError(
        f"the checkpoint has no {prefixes[0]}{name} (nor under {', '.join(prefixes[1:])}): not "
        "a Gemma 3 vision checkpoint, or an incomplete one."
    )


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
    fill_image_encoder(encoder, weights)
    return encoder


def fill_image_encoder(encoder: Gemma3ImageEncoder, weights: Mapping[str, Any]) -> None:
    """`encoder`'s parameters set from `weights` (HF names -> arrays); HFError naming a
    missing or misshapen tensor."""
    vision = encoder.vision_tower.config
    t = lambda name: _take(weights, TOWER, name)  # noqa: E731
    tower = encoder.vision_tower
    d, n = vision.hidden_size, vision.num_attention_heads
    h = d // n
    _set(tower.patch_embed.kernel, t("embeddings.patch_embedding.weight").reshape(d, -1).T)
    _set(tower.patch_embed.bias, t("embeddings.patch_embedding.bias"))
    _set(tower.position_embedding, t("embeddings.position_embedding.weight"))
    for i, layer in enumerate(tower.layers):
        at = lambda name, i=i: t(f"encoder.layers.{i}.{name}")  # noqa: E731
        for ours, theirs in (
            ("layernorm_before", "layer_norm1"),
            ("layernorm_after", "layer_norm2"),
        ):
            _set(getattr(layer, ours).weight, at(f"{theirs}.weight"))
            _set(getattr(layer, ours).bias, at(f"{theirs}.bias"))
        qkv = [at(f"self_attn.{p}_proj.weight").T.reshape(d, n, h) for p in "qkv"]
        _set(layer.qkv.kernel, np.stack(qkv, axis=1))
        _set(layer.qkv.bias, np.stack([at(f"self_attn.{p}_proj.bias").reshape(n, h)
                                       for p in "qkv"]))  # fmt: skip
        _set(layer.out.kernel, at("self_attn.out_proj.weight").T.reshape(n, h, d))
        _set(layer.out.bias, at("self_attn.out_proj.bias"))
        for fc in ("fc1", "fc2"):
            _set(getattr(layer, fc).kernel, at(f"mlp.{fc}.weight").T)
            _set(getattr(layer, fc).bias, at(f"mlp.{fc}.bias"))
    _set(tower.post_layernorm.weight, t("post_layernorm.weight"))
    _set(tower.post_layernorm.bias, t("post_layernorm.bias"))
    projector = encoder.multi_modal_projector
    _set(projector.mm_soft_emb_norm.weight, _take(weights, PROJECTOR, "mm_soft_emb_norm.weight"))
    _set(projector.mm_input_projection, _take(weights, PROJECTOR, "mm_input_projection_weight"))


def _set(param: nnx.Param, value: np.ndarray) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise HFError(f"a Gemma 3 image encoder weight of shape {value.shape} where "
                      f"{tuple(param.shape)} was expected: another architecture.")  # fmt: skip
    param[...] = value.astype(param.dtype)
