"""Gemma 3 with images (HF's Gemma3ForConditionalGeneration) in Flax NNX: the image encoder
(models/gemma3_vision.py) turns each image into mm_tokens_per_image soft tokens, which take the
places of the image's placeholder tokens (`image_token_id`) in the decoder's input (unscaled,
where text tokens are embedded and scaled by sqrt(hidden)); an image's tokens see each other
both ways, the rest stays causal (sliding layers: within their window).

``model(input_ids [B, T], pixel_values [I, C, H, W]) -> logits [B, T, V]``: the images in the
order their placeholders appear, row by row.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.gemma import GemmaConfig, GemmaForCausalLM
from jaxtrain.models.gemma3_vision import Gemma3ImageEncoder
from jaxtrain.models.llama import ACT_BTV
from jaxtrain.models.masking import apply_padding_mask
from jaxtrain.models.sharding import constrain
from jaxtrain.models.siglip import SiglipVisionConfig

Array = jax.Array
DType = Any

__all__ = ["Gemma3ForConditionalGeneration", "image_blocks"]


def image_blocks(is_image: Array) -> Array:
    """[B, T] int32: each run of image tokens numbered from 0 per row, -1 elsewhere (the
    groups whose tokens attend to each other both ways, as HF's block_sequence_ids)."""
    starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(is_image, jnp.cumsum(starts, axis=1) - 1, -1).astype(jnp.int32)


class Gemma3ForConditionalGeneration(nnx.Module):
    """Gemma 3's vision-language model: ``language_model`` (a GemmaForCausalLM) and
    ``vision`` (its image encoder); see the module docstring."""

    def __init__(
        self,
        text: GemmaConfig,
        vision: SiglipVisionConfig,
        *,
        mm_tokens_per_image: int,
        image_token_id: int,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.language_model = GemmaForCausalLM(text, **kw)
        self.vision = Gemma3ImageEncoder(vision, text.hidden_size, mm_tokens_per_image, **kw)
        self.mm_tokens_per_image, self.image_token_id = mm_tokens_per_image, image_token_id
        self.config = text

    def embeddings(self, input_ids: Array, pixel_values: Array | None) -> tuple[Array, Array]:
        """(the decoder's input [B, T, D], each token's image block [B, T])."""
        lm = self.language_model.model
        is_image = input_ids == self.image_token_id
        # The placeholder may lie outside the vocabulary: its embedding is never read.
        x = lm.embed(jnp.where(is_image, 0, input_ids))
        if pixel_values is None:
            return x, jnp.full(input_ids.shape, -1, jnp.int32)
        tokens = self.vision(pixel_values)  # [I, tokens, D]
        flat = tokens.reshape(-1, tokens.shape[-1]).astype(x.dtype)
        # The k-th image token of the batch (row-major) takes the k-th soft token.
        order = jnp.clip(jnp.cumsum(is_image.reshape(-1)) - 1, 0, flat.shape[0] - 1)
        x = jnp.where(is_image[..., None], flat[order].reshape(x.shape), x)
        return x, image_blocks(is_image)

    def __call__(
        self,
        input_ids: Array,
        pixel_values: Array | None = None,
        *,
        positions: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        lm = self.language_model
        x, blocks = self.embeddings(input_ids, pixel_values)
        positions, segment_ids = apply_padding_mask(attention_mask, input_ids, positions, None)
        if positions is None:
            positions = np.arange(input_ids.shape[1], dtype=np.int32)[None]
        h = lm.model(
            input_ids, positions, segment_ids, remat_policy=lm.remat_policy,
            implementation=lm.attention_implementation, embeddings=x, bidirectional_ids=blocks,
        )  # fmt: skip
        return constrain(lm.output_projection()(h), ACT_BTV)
