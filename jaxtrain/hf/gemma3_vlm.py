"""Gemma 3 with images (`gemma3`, Gemma3ForConditionalGeneration) and Hugging Face: its
config both ways, and its tensors: the decoder's through the Gemma text maps (hf/gemma.py, under
`language_model.`), the image encoder's through hf/gemma3_vision.py; a checkpoint of any layout
(the Hub's, transformers 5's) is read by its names made canonical first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from jaxtrain.hf.errors import HFError
from jaxtrain.hf.gemma import from_hf_gemma_config, gemma_param_maps, to_hf_gemma_config
from jaxtrain.hf.gemma3_vision import (
    apply_param_maps,
    canonical_name,
    image_encoder_param_maps,
    siglip_from_hf,
)
from jaxtrain.hf.registry import ModelFamily
from jaxtrain.hf.weights import ParamMap
from jaxtrain.models.gemma3_vlm import Gemma3ForConditionalGeneration, Gemma3VisionConfig

__all__ = [
    "GEMMA3",
    "from_hf_gemma3_config",
    "gemma3_param_maps",
    "load_gemma3_vlm",
    "to_hf_gemma3_config",
]


def from_hf_gemma3_config(hf: Mapping[str, Any], source: str = "config.json") -> Gemma3VisionConfig:
    if hf.get("model_type") != "gemma3":
        raise HFError(f"{source}: model_type {hf.get('model_type')!r} is not 'gemma3'.")
    for part in ("text_config", "vision_config"):
        if not isinstance(hf.get(part), Mapping):
            raise HFError(f"{source}: {part} is missing: not a Gemma 3 vision checkpoint.")
    text = from_hf_gemma_config(dict(hf["text_config"]), source=f"{source} text_config")
    try:
        return Gemma3VisionConfig(
            text=text, vision=siglip_from_hf(hf["vision_config"]),
            mm_tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
            image_token_id=int(hf.get("image_token_id", hf.get("image_token_index", 262144))),
            boi_token_id=hf.get("boi_token_id", hf.get("boi_token_index")),
            eoi_token_id=hf.get("eoi_token_id", hf.get("eoi_token_index")),
        )  # fmt: skip
    except ValueError as err:
        raise HFError(f"{source}: {err}") from None


def to_hf_gemma3_config(config: Gemma3VisionConfig, dtype: str = "float32") -> dict[str, Any]:
    vision = {**config.vision.to_dict(), "model_type": "siglip_vision_model",
              "vision_use_head": False}  # fmt: skip
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": to_hf_gemma_config(config.text, dtype),
        "vision_config": vision,
        "mm_tokens_per_image": config.mm_tokens_per_image,
        "image_token_index": config.image_token_id,
        "boi_token_index": config.boi_token_id,
        "eoi_token_index": config.eoi_token_id,
        "initializer_range": config.text.initializer_range,
        "tie_word_embeddings": config.text.tie_word_embeddings,
        "dtype": dtype,
    }


def gemma3_param_maps(config: Gemma3VisionConfig) -> list[ParamMap]:
    """A ParamMap per parameter of Gemma3ForConditionalGeneration, by the Hub's names."""
    decoder = [
        ParamMap(f"language_model/{m.path}", tuple(f"language_model.{n}" for n in m.hf_names),
                 m.hf_shapes, m.to_jax, m.to_hf)
        for m in gemma_param_maps(config.text)
    ]  # fmt: skip
    return decoder + image_encoder_param_maps(config.vision, config.text.hidden_size, "vision/")


def load_gemma3_vlm(
    hf_config: Mapping[str, Any], weights: Mapping[str, Any], source: str = "config.json", **kw: Any
) -> Gemma3ForConditionalGeneration:
    """The model of a `gemma3` config.json (a dict) holding `weights` (HF names of any layout ->
    arrays); kw: dtypes. HFError naming a missing tensor or an unsupported field."""
    config = from_hf_gemma3_config(hf_config, source)
    model = Gemma3ForConditionalGeneration(config, rngs=nnx.Rngs(0), **kw)
    apply_param_maps(model, gemma3_param_maps(config), weights, source)
    return model


def gemma3_ignorable(name: str, config: Gemma3VisionConfig) -> bool:
    """A tied output head's copy carries no weights of its own, and the tower's pooling head
    (SigLIP's, kept by some checkpoints) is not on Gemma 3's path: it reads every patch."""
    name = canonical_name(name)
    tied = config.text.tie_word_embeddings and name == "language_model.lm_head.weight"
    return tied or name.startswith("vision_tower.vision_model.head.")


GEMMA3 = ModelFamily(
    name="gemma3",
    model_types=("gemma3",),
    model_class=Gemma3ForConditionalGeneration,
    from_hf_config=from_hf_gemma3_config,
    to_hf_config=to_hf_gemma3_config,
    param_maps=gemma3_param_maps,
    ignorable=gemma3_ignorable,
    canonical_name=canonical_name,
)
