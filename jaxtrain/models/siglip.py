"""The SigLIP vision tower (Gemma 3's image encoder) in Flax NNX: patch embedding, learned
position embeddings, pre-norm encoder layers (ViT's: models/vit.py), a final LayerNorm.

``tower(pixel_values [B, C, H, W]) -> [B, patches, hidden]``, the patches row-major, as HF's
SiglipVisionModel's last_hidden_state (no class token, no pooling head). No dropout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.blocks import LayerNorm
from jaxtrain.models.initial_values import normal_param_values
from jaxtrain.models.layers import Projection
from jaxtrain.models.vit import ViTConfig, ViTLayer

Array = jax.Array
DType = Any

__all__ = ["SiglipVisionConfig", "SiglipVisionModel"]


@dataclass
class SiglipVisionConfig:
    """Architecture of a SigLIP vision tower (HF SiglipVisionConfig's field names)."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    model_type: str = "siglip_vision_model"

    def __post_init__(self) -> None:
        self.layer_config()  # ViT's checks: sizes, divisibility, the activation

    def layer_config(self) -> ViTConfig:
        """The encoder layers' shape, as ViT's (the same layer)."""
        return ViTConfig(
            image_size=self.image_size, patch_size=self.patch_size,
            num_channels=self.num_channels, hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            intermediate_size=self.intermediate_size, hidden_act=self.hidden_act,
            layer_norm_eps=self.layer_norm_eps, initializer_range=self.initializer_range,
        )  # fmt: skip

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __hash__(self) -> int:  # part of a model's static graph (nnx.split, jit)
        return hash(tuple(sorted(self.to_dict().items())))


class SiglipVisionModel(nnx.Module):
    """``tower(pixel_values [B, C, H, W]) -> [B, patches, hidden]`` (see the module doc)."""

    def __init__(
        self,
        config: SiglipVisionConfig,
        *,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        c = self.config = config
        self.dtype = dtype
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        p, n = c.patch_size, c.patches_per_side**2
        # The patch "convolution" (stride = kernel = patch) as one matmul over flat patches.
        self.patch_embed = Projection((c.num_channels * p * p, c.hidden_size), (None, "embed"),
                                      "bpk,kd->bpd", bias_ndim=1, **kw)  # fmt: skip
        self.position_embedding = nnx.Param(
            normal_param_values(rngs, (n, c.hidden_size), c.initializer_range, param_dtype),
            logical_axes=(None, "embed"),
        )
        layer = c.layer_config()
        self.layers = nnx.List(
            [ViTLayer(layer, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
             for _ in range(c.num_hidden_layers)]
        )  # fmt: skip
        self.post_layernorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps, dtype=dtype,
                                        param_dtype=param_dtype)  # fmt: skip

    def __call__(self, pixel_values: Array) -> Array:
        c = self.config
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != (
            c.num_channels, c.image_size, c.image_size
        ):  # fmt: skip
            raise ValueError(
                f"pixel_values must be [images, {c.num_channels}, {c.image_size}, "
                f"{c.image_size}], got shape {tuple(pixel_values.shape)}."
            )
        b, p, g = pixel_values.shape[0], c.patch_size, c.patches_per_side
        x = pixel_values.astype(self.dtype)
        x = x.reshape(b, c.num_channels, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
        x = self.patch_embed(x.reshape(b, g * g, -1))  # patches row-major, (C, p, p) flat
        x = x + self.position_embedding[...].astype(self.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)
