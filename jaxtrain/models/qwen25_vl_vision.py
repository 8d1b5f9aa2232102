"""Qwen2.5-VL's vision tower in Flax NNX (HF's Qwen2_5_VisionTransformerPretrainedModel): the
3-D patch embedding, 2-D rotary embedding, pre-norm blocks (RMSNorm, attention, SwiGLU MLP)
attending within windows or, in `fullatt_block_indexes`, within their image, and the patch
merger (spatial_merge_size^2 patches -> one token of the decoder's width).

``tower(pixel_values [N, C*T*P*P], layout) -> [N / merge^2, out_hidden_size]``: the flat
patches of every image of a batch, as the image processor writes them (each image's patches
merge unit by merge unit), and the merged tokens in the same order. Or per row,
``[B, N, C*T*P*P] -> [B, N / merge^2, out]``: each row's own images (`row_layouts`), the
layout a data-parallel batch shards by rows.

Static shapes. The grids (`image_grid_thw` [images, 3]) decide which patches attend to which
and each patch's rotary position. HF turns them into index lists and cumulative lengths and
runs one attention per window; under jit that would make every new set of image sizes a new
program and its loops data dependent. Here `vision_layout` computes, on the host with numpy,
three arrays of one entry per patch: its (row, column) in its image, its window and its
frame (an image). Attention then is one masked attention over all N patches (a patch sees
the patches of its window, or of its frame in the full-attention blocks): order does not
matter to attention without a causal mask, so the patches keep the processor's order and
HF's window permutation is never needed. The program depends only on N: a data pipeline
that pads pixel_values to a fixed number of patches (padding patches in a layout entry of
their own, frame and window -1) compiles once for any mix of image sizes. The cost is the
dense [N, N] mask and scores of the whole batch's patches (N^2 per head, where HF's per-window
kernels cost the windows' sizes squared); fine for fine-tuning batches of a few images,
a blockwise kernel over the windows is what longer inputs would need.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.models.attention import grouped_attention
from jaxtrain.models.blocks import gated, gelu
from jaxtrain.models.elementwise import apply_rope
from jaxtrain.models.layers import Projection, RMSNorm

Array = jax.Array
DType = Any

__all__ = [
    "Qwen25VisionConfig",
    "Qwen25VisionTransformer",
    "VisionLayout",
    "row_layouts",
    "vision_layout",
]

_NORM_EPS = 1e-6  # HF's vision RMSNorms (the blocks' and the merger's) fix it


@dataclass
class Qwen25VisionConfig:
    """Architecture of the tower (HF Qwen2_5_VLVisionConfig's field names; `rope_theta` is
    its rope_parameters' theta)."""

    depth: int = 32
    hidden_size: int = 1280
    hidden_act: str = "silu"
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = field(default=(7, 15, 23, 31))
    initializer_range: float = 0.02
    rope_theta: float = 10000.0
    model_type: str = "qwen2_5_vl_vision"

    def __post_init__(self) -> None:
        self.fullatt_block_indexes = tuple(int(i) for i in self.fullatt_block_indexes)
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a head "
                "size divisible by 4 (the 2-D rotary splits it between rows and columns)."
            )
        if self.hidden_act != "silu":  # Qwen2.5-VL's towers are all SwiGLU
            raise ValueError(f"vision hidden_act={self.hidden_act!r} is not supported: 'silu' is.")
        if self.window_size < self.patch_size * self.spatial_merge_size:
            raise ValueError(
                f"window_size={self.window_size} is smaller than one merge unit "
                f"({self.patch_size * self.spatial_merge_size} pixels)."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """The length of one flat patch, C * T * P * P (pixel_values' last dim)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_window(self) -> int:
        """A window's side in merge units (HF's vit_merger_window_size)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def num_parameters(self) -> int:
        d, f, m = self.hidden_size, self.intermediate_size, self.spatial_merge_size**2
        block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (3 * d * f + 2 * f + d)
        merger = d + (m * d) ** 2 + m * d + m * d * self.out_hidden_size + self.out_hidden_size
        return self.patch_dim * d + self.depth * block + merger

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {**out, "fullatt_block_indexes": list(self.fullatt_block_indexes)}

    def __hash__(self) -> int:  # part of a model's static graph (nnx.split, jit)
        return hash(tuple(sorted((k, str(v)) for k, v in self.to_dict().items())))


class VisionLayout(NamedTuple):
    """Per patch of pixel_values (int32 [N] each, [B, N] per row): its row and column in its
    image, its window and its frame (ids unique in the batch; -1: a padding patch)."""

    rows: Any
    cols: Any
    windows: Any
    frames: Any


def vision_layout(
    image_grid_thw: Any, config: Qwen25VisionConfig, num_patches: int | None = None
) -> VisionLayout:
    """The layout of the patches of images with grids `image_grid_thw` [images, 3] (t, h, w
    in patches), computed on the host; `num_patches`: pad to that many (padding patches get
    frame and window -1 and attend only among themselves)."""
    grids = np.asarray(image_grid_thw, np.int64).reshape(-1, 3)
    m, ws = config.spatial_merge_size, config.merge_window
    parts: list[list[np.ndarray]] = [[], [], [], []]
    frame = window = 0
    for t, h, w in grids.tolist():
        if h % m or w % m:
            raise ValueError(f"an image grid of {h} x {w} patches is not a multiple of {m}.")
        # The processor's patch order: merge unit by merge unit, row-major within each.
        rows = np.arange(h).reshape(h // m, m, 1, 1).repeat(w // m, 2).repeat(m, 3)
        cols = np.arange(w).reshape(1, 1, w // m, m).repeat(h // m, 0).repeat(m, 1)
        rows, cols = rows.transpose(0, 2, 1, 3).ravel(), cols.transpose(0, 2, 1, 3).ravel()
        across = -(-(w // m) // ws)  # windows per row of windows
        local = (rows // m // ws) * across + (cols // m // ws)
        per_frame = -(-(h // m) // ws) * across
        for i in range(t):
            parts[0].append(rows)
            parts[1].append(cols)
            parts[2].append(local + window + i * per_frame)
            parts[3].append(np.full(h * w, frame + i))
        frame, window = frame + t, window + t * per_frame
    arrays = [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]
    n = len(arrays[0])
    if num_patches is not None:
        if num_patches < n:
            raise ValueError(f"the images have {n} patches, more than num_patches={num_patches}.")
        pad = num_patches - n
        arrays = [np.pad(arrays[0], (0, pad)), np.pad(arrays[1], (0, pad)),
                  np.pad(arrays[2], (0, pad), constant_values=-1),
                  np.pad(arrays[3], (0, pad), constant_values=-1)]  # fmt: skip
    return VisionLayout(*(a.astype(np.int32) for a in arrays))


def row_layouts(row_grids: list[Any], config: Qwen25VisionConfig, num_patches: int) -> VisionLayout:
    """The layout [B, num_patches] of per-row pixel_values [B, num_patches, patch_dim]:
    row b holds the patches of the images of grids `row_grids[b]` ([images, 3], maybe none),
    then padding."""
    rows = [vision_layout(g, config, num_patches) for g in row_grids]
    return VisionLayout(*(np.stack(part) for part in zip(*rows)))


def _rotary(layout: VisionLayout, config: Qwen25VisionConfig) -> tuple[Array, Array]:
    """cos and sin [B, N, head_dim] (layout [B, N]): a quarter of the frequencies rotate by
    the patch's row, a quarter by its column, each half of the head as HF's rotate_half pairs
    them."""
    quarter = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float64) / quarter))
    inv_freq = jnp.asarray(inv_freq.astype(np.float32))
    rows = jnp.asarray(layout.rows, jnp.float32)[..., None] * inv_freq
    cols = jnp.asarray(layout.cols, jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([rows, cols, rows, cols], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


class VisionBlock(nnx.Module):
    """x + attn(norm1(x)); x + mlp(norm2(x)) (HF's Qwen2_5_VLVisionBlock)."""

    def __init__(self, c: Qwen25VisionConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        d, f, n, h = c.hidden_size, c.intermediate_size, c.num_heads, c.head_dim
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = dict(eps=_NORM_EPS, dtype=dtype, param_dtype=param_dtype)
        self.norm1, self.norm2 = RMSNorm(d, **norm), RMSNorm(d, **norm)
        self.qkv = Projection((d, 3, n, h), ("embed", "qkv", "heads", "head_dim"),
                              "btd,dcnh->btcnh", bias_ndim=3, **kw)  # fmt: skip
        self.proj = Projection((n, h, d), ("heads", "head_dim", "embed"), "btnh,nhd->btd",
                               bias_ndim=1, **kw)  # fmt: skip
        self.gate_proj = Projection((d, f), ("embed", "mlp"), "btd,df->btf", bias_ndim=1, **kw)
        self.up_proj = Projection((d, f), ("embed", "mlp"), "btd,df->btf", bias_ndim=1, **kw)
        self.down_proj = Projection((f, d), ("mlp", "embed"), "btf,fd->btd", bias_ndim=1, **kw)

    def __call__(self, x: Array, cos: Array, sin: Array, mask: Array) -> Array:
        qkv = self.qkv(self.norm1(x))  # [1, N, 3, heads, head_dim]
        # HF rotates in float32 whatever the compute dtype.
        q, k = (apply_rope(qkv[:, :, i].astype(jnp.float32), cos, sin) for i in (0, 1))
        v = qkv[:, :, 2]
        out = grouped_attention(q.astype(v.dtype), k.astype(v.dtype), v, mask)
        x = x + self.proj(out)
        h = self.norm2(x)
        gate, up = self.gate_proj(h), self.up_proj(h)
        return x + self.down_proj(gated(jax.nn.silu, gate, up))


class PatchMerger(nnx.Module):
    """RMSNorm each patch, concatenate a merge unit's merge^2 patches, then a GELU MLP to the
    decoder's width (HF's Qwen2_5_VLPatchMerger)."""

    def __init__(self, c: Qwen25VisionConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        wide = c.hidden_size * c.spatial_merge_size**2
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.wide = wide
        self.ln_q = RMSNorm(c.hidden_size, eps=_NORM_EPS, dtype=dtype, param_dtype=param_dtype)
        self.fc1 = Projection((wide, wide), (None, "mlp"), "btd,df->btf", bias_ndim=1, **kw)
        self.fc2 = Projection((wide, c.out_hidden_size), ("mlp", "embed"), "btf,fd->btd",
                              bias_ndim=1, **kw)  # fmt: skip

    def __call__(self, x: Array) -> Array:
        x = self.ln_q(x).reshape(x.shape[0], -1, self.wide)  # a merge unit's patches in a run
        return self.fc2(gelu(self.fc1(x), "gelu"))  # nn.GELU(): the exact erf form


class Qwen25VisionTransformer(nnx.Module):
    """``tower(pixel_values [N, patch_dim], layout) -> [N / merge^2, out_hidden_size]``, or
    per row [B, N, patch_dim] -> [B, N / merge^2, out_hidden_size] (see the module doc)."""

    def __init__(
        self,
        config: Qwen25VisionConfig,
        *,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        c = self.config = config
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # The Conv3d (stride = kernel) as one matmul over the flat (C, T, P, P) patches.
        self.patch_embed = Projection((c.patch_dim, c.hidden_size), (None, "embed"),
                                      "btk,kd->btd", std=c.initializer_range, **kw)  # fmt: skip
        self.blocks = nnx.List([VisionBlock(c, **kw) for _ in range(c.depth)])
        self.merger = PatchMerger(c, **kw)

    def __call__(self, pixel_values: Array, layout: VisionLayout) -> Array:
        c = self.config
        if pixel_values.ndim not in (2, 3) or pixel_values.shape[-1] != c.patch_dim:
            raise ValueError(
                f"pixel_values must be [patches, {c.patch_dim}] (the image processor's flat "
                f"patches) or [rows, patches, {c.patch_dim}], got {tuple(pixel_values.shape)}."
            )
        if np.shape(layout.rows) != pixel_values.shape[:-1]:
            raise ValueError(
                f"the layout describes {np.shape(layout.rows)} patches, pixel_values holds "
                f"{pixel_values.shape[:-1]}: image_grid_thw does not match the pixels."
            )
        flat = pixel_values.ndim == 2
        x = pixel_values[None] if flat else pixel_values
        layout = VisionLayout(*(jnp.asarray(a).reshape(x.shape[:2]) for a in layout))
        x = self.patch_embed(x.astype(self.dtype))
        cos, sin = _rotary(layout, c)
        in_window = (layout.windows[:, :, None] == layout.windows[:, None, :])[:, None]
        in_frame = (layout.frames[:, :, None] == layout.frames[:, None, :])[:, None]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, in_frame if i in c.fullatt_block_indexes else in_window)
        merged = self.merger(x)
        return merged[0] if flat else merged
