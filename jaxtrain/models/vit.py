"""ViT image classifier in Flax NNX: patch embedding, class token or mean pooling, pre-norm
encoder, linear head. The attribute tree mirrors HF's ViTForImageClassification (vit.embeddings,
vit.encoder.layer[i], vit.layernorm, classifier) so weight import is a rename plus reshape.

``model(pixel_values)`` takes [B, C, H, W] floats (HF's layout) and returns logits
[B, num_labels]. No dropout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.attention import grouped_attention
from jaxtrain.models.blocks import GELU_ACTS, LayerNorm, gelu
from jaxtrain.models.initial_values import normal_param_values
from jaxtrain.models.layers import Projection

Array = jax.Array
DType = Any
POOLINGS = ("cls", "mean")


@dataclass
class ViTConfig:
    """Architecture of a ViT classifier (HF ViTConfig field names, plus ``pooling``)."""

    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    num_labels: int = 2
    pooling: str = "cls"  # "cls": the class token's output (HF); "mean": mean of patch outputs
    model_type: str = "vit"

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "num_channels", "hidden_size",
                     "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "num_labels"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size ({self.image_size}) must be a multiple of patch_size "
                f"({self.patch_size})."
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads.")
        if self.hidden_act not in GELU_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r}: use one of {sorted(GELU_ACTS)}.")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r} is not one of {POOLINGS}.")

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.to_dict().items())))

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        d, f, p, c = self.hidden_size, self.intermediate_size, self.patch_size, self.num_channels
        layer = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        embed = c * p * p * d + d + d + (self.num_patches + 1) * d
        head = d * self.num_labels + self.num_labels
        return embed + self.num_hidden_layers * layer + 2 * d + head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ViTLayer(nnx.Module):
    def __init__(self, c: ViTConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(eps=c.layer_norm_eps, dtype=dtype, param_dtype=param_dtype)
        n, h = c.num_attention_heads, c.head_dim
        self.act = c.hidden_act
        self.layernorm_before = LayerNorm(c.hidden_size, **norm)
        self.qkv = Projection((c.hidden_size, 3, n, h), ("embed", "qkv", "heads", "head_dim"),
                              "btd,dcnh->btcnh", bias_ndim=3, **kw)  # fmt: skip
        self.out = Projection((n, h, c.hidden_size), ("heads", "head_dim", "embed"),
                              "btnh,nhd->btd", bias_ndim=1, **kw)  # fmt: skip
        self.layernorm_after = LayerNorm(c.hidden_size, **norm)
        self.fc1 = Projection((c.hidden_size, c.intermediate_size), ("embed", "mlp"),
                              "btd,df->btf", bias_ndim=1, **kw)  # fmt: skip
        self.fc2 = Projection((c.intermediate_size, c.hidden_size), ("mlp", "embed"),
                              "btf,fd->btd", bias_ndim=1, **kw)  # fmt: skip

    def __call__(self, x: Array) -> Array:
        qkv = self.qkv(self.layernorm_before(x))  # [B, T, 3, N, H]
        attn = grouped_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], mask=None)
        x = x + self.out(attn)
        return x + self.fc2(gelu(self.fc1(self.layernorm_after(x)), self.act))


class ViTForImageClassification(nnx.Module):
    """ViT classifier: ``model(pixel_values [B, C, H, W]) -> logits [B, num_labels]``."""

    # With LoRA (adapters on qkv, out, fc1, fc2) the new head stays trainable (models/lora.py).
    lora_keep = ("classifier",)

    def __init__(
        self,
        config: ViTConfig,
        *,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if not isinstance(config, ViTConfig):
            raise ValueError(f"config must be a ViTConfig, got {type(config).__name__}.")
        c = self.config = config
        self.dtype = dtype
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        p = c.patch_size
        # The patch "convolution" (stride = kernel = patch) as one matmul over flat patches.
        self.patch_embed = Projection((c.num_channels * p * p, c.hidden_size), (None, "embed"),
                                      "bpk,kd->bpd", bias_ndim=1, **kw)  # fmt: skip
        std = c.initializer_range
        self.cls_token = nnx.Param(
            normal_param_values(rngs, (c.hidden_size,), std, param_dtype), logical_axes=("embed",)
        )
        self.position_embeddings = nnx.Param(
            normal_param_values(rngs, (c.num_patches + 1, c.hidden_size), std, param_dtype),
            logical_axes=(None, "embed"),
        )
        self.layers = nnx.List(
            [ViTLayer(c, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
             for _ in range(c.num_hidden_layers)]
        )  # fmt: skip
        self.layernorm = LayerNorm(c.hidden_size, eps=c.layer_norm_eps, dtype=dtype,
                                   param_dtype=param_dtype)  # fmt: skip
        self.classifier = Projection((c.hidden_size, c.num_labels), ("embed", None), "bd,dl->bl",
                                     bias_ndim=1, **kw)  # fmt: skip

    def __call__(self, pixel_values: Array) -> Array:
        c = self.config
        if pixel_values.ndim != 4 or pixel_values.shape[1:] != (
            c.num_channels, c.image_size, c.image_size
        ):  # fmt: skip
            raise ValueError(
                f"pixel_values must be [batch, {c.num_channels}, {c.image_size}, "
                f"{c.image_size}], got shape {tuple(pixel_values.shape)}."
            )
        b, p, g = pixel_values.shape[0], c.patch_size, c.image_size // c.patch_size
        x = pixel_values.reshape(b, c.num_channels, g, p, g, p).transpose(0, 2, 4, 1, 3, 5)
        x = self.patch_embed(x.reshape(b, g * g, -1))  # patches row-major, (C, p, p) flat
        cls = jnp.broadcast_to(self.cls_token[...].astype(self.dtype), (b, 1, c.hidden_size))
        x = jnp.concatenate([cls, x], axis=1) + self.position_embeddings[...].astype(self.dtype)
        for layer in self.layers:
            x = layer(x)
        x = self.layernorm(x)
        pooled = x[:, 0] if c.pooling == "cls" else x[:, 1:].mean(axis=1)
        return self.classifier(pooled)


def classification_sums(logits: Array, labels: Array) -> dict[str, Array]:
    """Objective sums of a classifier: cross-entropy, correct predictions, examples counted
    (labels < 0 are ignored, e.g. filler rows)."""
    logits = logits.astype(jnp.float32)
    mask = labels >= 0
    safe = jnp.where(mask, labels, 0)
    target = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    nll = (jax.nn.logsumexp(logits, axis=-1) - target) * mask
    correct = (target >= logits.max(axis=-1)) & mask
    return {
        "loss_sum": nll.sum(),
        "correct": correct.sum().astype(jnp.float32),
        "tokens": mask.sum().astype(jnp.float32),
    }
