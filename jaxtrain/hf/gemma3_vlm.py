"""Gemma 3 with images (`gemma3`, Gemma3ForConditionalGeneration) from a Hugging Face config
and weights: the decoder's tensors through the Gemma text maps (hf/gemma.py; their names under
`language_model.model.` on the Hub, `model.language_model.` in transformers 5), the image
encoder's through hf/gemma3_vision.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx

from jaxtrain.hf.errors import HFError
from jaxtrain.hf.gemma import from_hf_gemma_config, gemma_param_maps
from jaxtrain.hf.gemma3_vision import LANGUAGE, fill_image_encoder, siglip_from_hf
from jaxtrain.models.gemma3_vlm import Gemma3ForConditionalGeneration
from jaxtrain.pytrees import path_str

__all__ = ["load_gemma3_vlm"]


def load_gemma3_vlm(
    hf_config: Mapping[str, Any], weights: Mapping[str, Any], source: str = "config.json", **kw: Any
) -> Gemma3ForConditionalGeneration:
    """The model of a `gemma3` config.json (a dict) holding `weights` (HF names -> arrays);
    kw: dtypes. HFError naming a missing tensor or an unsupported field."""
    if hf_config.get("model_type") != "gemma3":
        raise HFError(f"{source}: model_type {hf_config.get('model_type')!r} is not 'gemma3'.")
    text = from_hf_gemma_config(dict(hf_config["text_config"]), source=f"{source} text_config")
    image_token = hf_config.get("image_token_id", hf_config.get("image_token_index"))
    model = Gemma3ForConditionalGeneration(
        text, siglip_from_hf(hf_config["vision_config"]),
        mm_tokens_per_image=int(hf_config["mm_tokens_per_image"]),
        image_token_id=int(image_token), rngs=nnx.Rngs(0), **kw,
    )  # fmt: skip
    # The decoder's tensors renamed as a text-only Gemma 3 names them.
    decoder = {}
    for name, value in weights.items():
        for prefix in LANGUAGE:
            if name.startswith(prefix):
                decoder["model." + name[len(prefix) :]] = value
    if "lm_head.weight" in weights:
        decoder["lm_head.weight"] = weights["lm_head.weight"]
    params = {
        path_str(path): var
        for path, var in nnx.to_flat_state(nnx.state(model.language_model, nnx.Param))
    }
    for spec in gemma_param_maps(text):
        missing = [n for n in spec.hf_names if n not in decoder]
        if missing:
            raise HFError(f"{source}: the checkpoint has no decoder tensor {missing[0]!r} "
                          f"(under {' or '.join(LANGUAGE)}).")  # fmt: skip
        value = spec.to_jax([np.asarray(decoder[n], np.float32) for n in spec.hf_names])
        var = params[spec.path]
        var.set_value(value.astype(var.value.dtype))
    fill_image_encoder(model.vision, weights)
    return model
