"""Gemma 3 with images (HF's Gemma3ForConditionalGeneration) in Flax NNX: the image encoder
(models/gemma3_vision.py) turns each image into mm_tokens_per_image soft tokens, which take the
places of the image's placeholder tokens (`image_token_id`) in the decoder's input (unscaled,
where text tokens are embedded and scaled by sqrt(hidden)); an image's tokens see each other
both ways, the rest stays causal (sliding layers: within their window).

``model(input_ids [B, T], pixel_values) -> logits [B, T, V]``; `pixel_values` [I, C, H, W] are
the batch's images in the order their placeholders appear, row by row, or [B, K, C, H, W] each
row's K image slots (jaxtrain's batches, data/vision.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.config import DecoderFields, two_tower_config
from jaxtrain.models.gemma import GemmaConfig, GemmaForCausalLM
from jaxtrain.models.gemma3_vision import Gemma3ImageEncoder
from jaxtrain.models.llama import ACT_BTV
from jaxtrain.models.masking import apply_padding_mask
from jaxtrain.models.sharding import constrain
from jaxtrain.models.siglip import SiglipVisionConfig

Array = jax.Array
DType = Any

__all__ = ["Gemma3ForConditionalGeneration", "Gemma3VisionConfig", "image_blocks"]


@dataclass
class Gemma3VisionConfig(DecoderFields):
    """Gemma 3 with images: its decoder's config, its vision tower's, and how images enter the
    text (HF Gemma3Config's fields). The decoder's sizes and special tokens read through."""

    text: GemmaConfig
    vision: SiglipVisionConfig
    mm_tokens_per_image: int = 256
    image_token_id: int = 262144
    boi_token_id: int | None = None  # the tokens around an image (the processor writes them)
    eoi_token_id: int | None = None
    model_type: str = "gemma3"

    def __post_init__(self) -> None:
        side = int(round(self.mm_tokens_per_image**0.5))
        if side * side != self.mm_tokens_per_image or self.vision.patches_per_side % side:
            raise ValueError(
                f"mm_tokens_per_image={self.mm_tokens_per_image} must be a square whose side "
                f"divides the {self.vision.patches_per_side} patches per side of an image."
            )

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of the images the vision tower takes."""
        v = self.vision
        return (v.num_channels, v.image_size, v.image_size)

    def num_parameters(self) -> int:
        v = self.vision
        d, f, p = v.hidden_size, v.intermediate_size, v.patch_size
        layer = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        tower = v.num_channels * p * p * d + d + v.patches_per_side**2 * d
        tower += v.num_hidden_layers * layer + 2 * d
        return self.text.num_parameters() + tower + d + d * self.text.hidden_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Gemma3VisionConfig:
        """The config of `to_dict`'s dict (a run's model section): its two towers nested."""
        return two_tower_config(cls, d, GemmaConfig, SiglipVisionConfig, "Gemma 3 vision")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**out, "text": self.text.to_dict(), "vision": self.vision.to_dict()}

    def __hash__(self) -> int:
        return hash((self.text, self.vision, self.mm_tokens_per_image, self.image_token_id))


def image_blocks(is_image: Array) -> Array:
    """[B, T] int32: each run of image tokens numbered from 0 per row, -1 elsewhere (the
    groups whose tokens attend to each other both ways, as HF's block_sequence_ids)."""
    starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(is_image, jnp.cumsum(starts, axis=1) - 1, -1).astype(jnp.int32)


class Gemma3ForConditionalGeneration(nnx.Module):
    """Gemma 3's vision-language model: ``language_model`` (a GemmaForCausalLM) and
    ``vision`` (its image encoder); see the module docstring."""

    # LoRA adapts the decoder; the image encoder keeps its weights. (PEFT names Gemma 3's
    # tower projections apart from their fused kernels here, and its projector is a bare
    # parameter that takes no adapter: adapters there could not be exported.)
    lora_skip = ("vision",)
    vision_tower_parts = ("vision.vision_tower",)  # what freeze_vision_tower keeps as it is
    peft_modules = r".*language_model\..*"  # where PEFT looks for the adapted modules

    def __init__(
        self,
        config: Gemma3VisionConfig,
        *,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.config = config
        self.dtype = dtype  # the compute dtype (a KV cache is held in it)
        self.language_model = GemmaForCausalLM(config.text, **kw)
        self.vision = Gemma3ImageEncoder(
            config.vision, config.text.hidden_size, config.mm_tokens_per_image, **kw
        )
        self.image_token_id = config.image_token_id

    @property
    def remat_policy(self) -> str:  # the decoder's settings (training/program.py sets them)
        return self.language_model.remat_policy

    @remat_policy.setter
    def remat_policy(self, value: str) -> None:
        self.language_model.remat_policy = value

    @property
    def attention_implementation(self) -> str | None:
        return self.language_model.attention_implementation

    @attention_implementation.setter
    def attention_implementation(self, value: str | None) -> None:
        self.language_model.attention_implementation = value

    def embeddings(self, input_ids: Array, pixel_values: Array | None) -> tuple[Array, Array]:
        """(the decoder's input [B, T, D], each token's image block [B, T]).

        `pixel_values`: [I, C, H, W], the batch's images in the order of their placeholders
        (transformers' layout), or [B, K, C, H, W], each row's own K image slots (a row's k-th
        image placeholder reads its slot k; the unused slots are never read)."""
        lm = self.language_model.model
        is_image = input_ids == self.image_token_id
        # The placeholder may lie outside the vocabulary: its embedding is never read.
        x = lm.embed(jnp.where(is_image, 0, input_ids))
        if pixel_values is None:
            return x, jnp.full(input_ids.shape, -1, jnp.int32)
        per_row = pixel_values.ndim == 5
        rows = input_ids.shape[0] if per_row else 1
        tokens = self.vision(pixel_values.reshape(-1, *pixel_values.shape[-3:]))  # [I, n, D]
        tokens = tokens.reshape(rows, -1, tokens.shape[-1]).astype(x.dtype)
        # The k-th image token of a row (of the whole batch, flat) takes soft token k.
        flat = is_image.reshape(rows, -1)
        order = jnp.clip(jnp.cumsum(flat, axis=1) - 1, 0, tokens.shape[1] - 1)
        soft = jnp.take_along_axis(tokens, order[..., None], axis=1).reshape(x.shape)
        return jnp.where(is_image[..., None], soft, x), image_blocks(is_image)

    def hidden_states(
        self,
        input_ids: Array,
        pixel_values: Array | None = None,
        *,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        """The decoder's final-norm hidden states [B, T, D] (packed rows: `segment_ids` and
        per-document `positions`, as the text models)."""
        lm = self.language_model
        x, blocks = self.embeddings(input_ids, pixel_values)
        positions, segment_ids = apply_padding_mask(
            attention_mask, input_ids, positions, segment_ids
        )
        if positions is None:
            positions = np.arange(input_ids.shape[1], dtype=np.int32)[None]
        return lm.model(
            input_ids, positions, segment_ids, remat_policy=lm.remat_policy,
            implementation=lm.attention_implementation, embeddings=x, bidirectional_ids=blocks,
            scan=lm.scan_layers,
        )  # fmt: skip

    def output_projection(self) -> Callable[[Array], Array]:
        return self.language_model.output_projection()

    def __call__(
        self,
        input_ids: Array,
        pixel_values: Array | None = None,
        *,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        h = self.hidden_states(
            input_ids, pixel_values, positions=positions, segment_ids=segment_ids,
            attention_mask=attention_mask,
        )  # fmt: skip
        return constrain(self.output_projection()(h), ACT_BTV)
