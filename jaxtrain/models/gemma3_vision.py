"""Gemma 3's image encoder: the SigLIP tower, then the multimodal projector (each side's
patches average-pooled to mm_tokens_per_image tokens, RMS-normed with (1 + w), projected to
the decoder's width), as HF's Gemma3Model.get_image_features computes it.

``encoder(pixel_values [B, C, H, W]) -> [B, mm_tokens_per_image, text hidden]``: the soft
tokens an image's placeholder tokens become in the decoder's input.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.gemma import GemmaRMSNorm
from jaxtrain.models.initial_values import normal_param_values
from jaxtrain.models.siglip import SiglipVisionConfig, SiglipVisionModel

Array = jax.Array
DType = Any

__all__ = ["Gemma3ImageEncoder", "Gemma3Projector"]


class Gemma3Projector(nnx.Module):
    """Patches [B, side^2, vision hidden] -> image tokens [B, tokens, text hidden]."""

    def __init__(
        self,
        vision: SiglipVisionConfig,
        text_hidden: int,
        mm_tokens_per_image: int,
        *,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        side = int(round(mm_tokens_per_image**0.5))
        if side * side != mm_tokens_per_image or vision.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image={mm_tokens_per_image} must be a square whose side divides "
                f"the {vision.patches_per_side} patches per side of the image."
            )
        self.patches, self.side, self.dtype = vision.patches_per_side, side, dtype
        self.mm_soft_emb_norm = GemmaRMSNorm(
            vision.hidden_size, eps=vision.layer_norm_eps, dtype=dtype, param_dtype=param_dtype
        )
        self.mm_input_projection = nnx.Param(
            normal_param_values(
                rngs, (vision.hidden_size, text_hidden), vision.initializer_range, param_dtype
            ),
            logical_axes=(None, "embed"),
        )

    def __call__(self, patches: Array) -> Array:
        b, _, d = patches.shape
        k = self.patches // self.side  # the pooling window (and stride)
        grid = patches.reshape(b, self.side, k, self.side, k, d)
        pooled = grid.astype(jnp.float32).mean(axis=(2, 4)).reshape(b, self.side**2, d)
        normed = self.mm_soft_emb_norm(pooled.astype(self.dtype))
        return jnp.einsum("btv,vd->btd", normed, self.mm_input_projection[...].astype(self.dtype))


class Gemma3ImageEncoder(nnx.Module):
    """``encoder(pixel_values) -> [B, mm_tokens_per_image, text hidden]`` (module doc)."""

    def __init__(
        self,
        vision: SiglipVisionConfig,
        text_hidden: int,
        mm_tokens_per_image: int,
        *,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.vision_tower = SiglipVisionModel(vision, **kw)
        self.multi_modal_projector = Gemma3Projector(vision, text_hidden, mm_tokens_per_image, **kw)

    def __call__(self, pixel_values: Array) -> Array:
        return self.multi_modal_projector(self.vision_tower(pixel_values))
