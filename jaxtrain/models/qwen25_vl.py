"""Qwen2.5-VL (HF's Qwen2_5_VLForConditionalGeneration) in Flax NNX: the vision tower
(models/qwen25_vl_vision.py) turns each image's patches into tokens that take the places of
its placeholder tokens (`image_token_id`) in the input of a Qwen2 decoder (the Llama family's
layers) whose rotary embedding is M-RoPE: each token has three positions (temporal, height,
width), and `mrope_section` says how many of the head's frequencies each one drives.

``model(input_ids [B, T], pixel_values [N, patch_dim], image_grid_thw [images, 3]) -> logits``:
the images' flat patches and grids as transformers' image processor writes them, in the
order their placeholders appear, row by row (the batch's k-th image token takes the k-th
merged token); or per row, pixel_values [B, N, patch_dim] with `layout` (each row's images in
its own padded slot, its k-th image token the row's k-th merged token).

Positions are computed on the host (`rope_positions`, HF's get_rope_index for images): text
counts up by one; an image's tokens take (t, row, column) offset by the position where it
starts, and the text after it goes on from that start plus the image's longer side in merged
tokens. A text-only row gets 0..T-1 in all three, the plain Qwen2 decoder's positions. Under
jit (traced input_ids) pass `positions` [3, B, T] from `rope_positions` and the tower's
`layout` from `vision_layout`, both computed where the batch is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.config.tables import REMAT_POLICIES, SCAN_LAYERS_DEFAULT
from jaxtrain.models.config import DecoderFields, LlamaConfig, two_tower_config
from jaxtrain.models.layer_scan import run_layers
from jaxtrain.models.layers import Embedding, Projection, RMSNorm, output_head, rope_inv_freq
from jaxtrain.models.llama import ACT_BTD, ACT_BTV, DecoderLayer, layer_step
from jaxtrain.models.masking import apply_padding_mask
from jaxtrain.models.qwen25_vl_vision import (
    Qwen25VisionConfig,
    Qwen25VisionTransformer,
    VisionLayout,
    vision_layout,
)
from jaxtrain.models.sharding import constrain

Array = jax.Array
DType = Any

__all__ = [
    "Qwen25VLConfig",
    "Qwen25VLForConditionalGeneration",
    "mrope_cos_sin",
    "rope_positions",
]


@dataclass
class Qwen25VLConfig(DecoderFields):
    """Qwen2.5-VL: its decoder's config (a qwen2 LlamaConfig), its tower's, M-RoPE's split
    and the special tokens (HF Qwen2_5_VLConfig's fields). The decoder's sizes and token ids
    read through."""

    text: LlamaConfig
    vision: Qwen25VisionConfig
    mrope_section: tuple[int, ...] = field(default=(16, 24, 24))
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    model_type: str = "qwen2_5_vl"

    def __post_init__(self) -> None:
        self.mrope_section = tuple(int(s) for s in self.mrope_section)
        if sum(self.mrope_section) != self.text.head_dim // 2:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must sum to head_dim / 2 = "
                f"{self.text.head_dim // 2} (the decoder's rotary frequencies)."
            )
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(
                f"vision out_hidden_size={self.vision.out_hidden_size} must equal the "
                f"decoder's hidden_size={self.text.hidden_size}."
            )

    @property
    def patch_dim(self) -> int:
        """The length of one flat patch of pixel_values (C * T * P * P)."""
        return self.vision.patch_dim

    def num_parameters(self) -> int:
        return self.text.num_parameters() + self.vision.num_parameters()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Qwen25VLConfig:
        """The config of `to_dict`'s dict (a run's model section): its two towers nested."""
        return two_tower_config(cls, d, LlamaConfig, Qwen25VisionConfig, "Qwen2.5-VL")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**out, "text": self.text.to_dict(), "vision": self.vision.to_dict(),
                "mrope_section": list(self.mrope_section)}  # fmt: skip

    def __hash__(self) -> int:
        return hash((self.text, self.vision, self.mrope_section, self.image_token_id))


def rope_positions(
    input_ids: Any,
    image_grid_thw: Any,
    config: Qwen25VLConfig,
    attention_mask: Any = None,
) -> np.ndarray:
    """M-RoPE positions [3, B, T] (int32, numpy) of rows whose image tokens belong, in order,
    to images of grids `image_grid_thw` [images, 3] (None: no image); padding (a 0 in
    `attention_mask`) is skipped and keeps 0, as HF's get_rope_index."""
    ids = np.asarray(input_ids)
    real = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask) != 0
    grids = np.zeros((0, 3), np.int64) if image_grid_thw is None else np.asarray(image_grid_thw)
    grids = grids.reshape(-1, 3).astype(np.int64)
    m = config.vision.spatial_merge_size
    out = np.zeros((3, *ids.shape), np.int32)
    image = 0
    for b in range(ids.shape[0]):
        row = ids[b][real[b]]
        pos, parts, i = 0, [], 0
        while i < len(row):
            if row[i] != config.image_token_id:
                j = i
                while j < len(row) and row[j] != config.image_token_id:
                    j += 1
                parts.append(np.broadcast_to(np.arange(pos, pos + j - i), (3, j - i)))
                pos, i = pos + j - i, j
                continue
            if image >= len(grids):
                raise ValueError(f"row {b} has more image tokens than image_grid_thw has images.")
            t, h, w = grids[image].tolist()
            h, w = h // m, w // m
            n = t * h * w
            if not (row[i : i + n] == config.image_token_id).all() or (
                i + n < len(row) and row[i + n] == config.image_token_id
            ):
                raise ValueError(
                    f"row {b}: image {image} (grid {t} x {h * m} x {w * m}) has {n} tokens, "
                    "its run of image tokens another count (a cut or an unlisted image)."
                )
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            parts.append(np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + pos)
            pos, i, image = pos + max(h, w), i + n, image + 1
        if parts:
            out[:, b, real[b]] = np.concatenate(parts, axis=1)
    if image != len(grids):
        raise ValueError(
            f"image_grid_thw has {len(grids)} images, the rows' image tokens fill {image}."
        )
    return out


def mrope_cos_sin(
    positions: Any, inv_freq: np.ndarray, section: tuple[int, ...], dtype: DType
) -> tuple[Array, Array]:
    """cos and sin [B, T, head_dim] of positions [3, B, T]: frequency j turns with the
    position component `section` assigns it (the first section[0] the temporal one, then
    height, then width), the halves laid out as HF's rotate_half."""
    component = np.repeat(np.arange(len(section)) % 3, section)
    if isinstance(positions, np.ndarray):  # constants of the program (as layers.rope_cos_sin)
        angles = positions[component].astype(np.float32) * inv_freq[:, None, None]
        angles = np.concatenate([angles, angles]).transpose(1, 2, 0)
        return jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype)
    chosen = jnp.asarray(positions)[component].astype(jnp.float32)  # [head_dim / 2, B, T]
    angles = jnp.moveaxis(chosen * jnp.asarray(inv_freq)[:, None, None], 0, -1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return (jnp.concatenate([cos, cos], -1).astype(dtype),
            jnp.concatenate([sin, sin], -1).astype(dtype))  # fmt: skip


class Qwen25VLTextModel(nnx.Module):
    """The decoder stack (HF's Qwen2_5_VLTextModel): Llama-family layers on input
    embeddings, rotated by M-RoPE's cos and sin."""

    def __init__(self, config: LlamaConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size,
                                      std=config.initializer_range, rngs=rngs, **kw)  # fmt: skip
        self.layers = nnx.List(
            [DecoderLayer(config, rngs=rngs, **kw) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, **kw)

    def __call__(
        self,
        x: Array,
        cos: Array,
        sin: Array,
        segment_ids: Array | None,
        *,
        remat_policy: str = "none",
        implementation: str | None = None,
        scan: bool = False,
    ) -> Array:
        x, _ = run_layers(
            self.layers, layer_step(implementation), constrain(x, ACT_BTD),
            (cos, sin, segment_ids), scan=scan, remat_policy=remat_policy,
        )  # fmt: skip
        return self.norm(x)


class Qwen25VLForConditionalGeneration(nnx.Module):
    """Qwen2.5-VL: ``model`` (the decoder), ``lm_head`` (None when tied) and ``visual`` (the
    vision tower), HF's names in the Hub's checkpoints; see the module docstring."""

    # LoRA adapts the decoder; the tower keeps its weights.
    lora_skip = ("visual",)
    # What freeze_vision_tower keeps as it is: the tower, not its patch merger (the projector).
    vision_tower_parts = ("visual.patch_embed", "visual.blocks")
    # Where PEFT looks for the adapted modules: the decoder's layers (the tower's blocks have
    # gate/up/down projections too, under `blocks`).
    peft_modules = r".*layers\.\d+\.(self_attn|mlp)"

    def __init__(
        self,
        config: Qwen25VLConfig,
        *,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        t = config.text
        self.config = config
        self.dtype = dtype
        self.remat_policy = "none"
        self.attention_implementation: str | None = None
        self.scan_layers = SCAN_LAYERS_DEFAULT  # the decoder's layers (models/layer_scan.py)
        self.model = Qwen25VLTextModel(t, **kw)
        if t.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Projection((t.hidden_size, t.vocab_size), ("embed", "vocab"),
                                      "btd,dv->btv", std=t.initializer_range, **kw)  # fmt: skip
        self.visual = Qwen25VisionTransformer(config.vision, **kw)
        self.image_token_id = config.image_token_id

    def embeddings(
        self,
        input_ids: Array,
        pixel_values: Array | None,
        image_grid_thw: Any = None,
        layout: VisionLayout | None = None,
    ) -> Array:
        """The decoder's input [B, T, D]: the k-th image token of the batch (row by row) is
        the k-th merged token of the images' flat patches [N, patch_dim]; with per-row
        patches [B, N, patch_dim] (and their `layout`, models/qwen25_vl_vision.row_layouts)
        the k-th image token of a row is the row's k-th merged token."""
        is_image = input_ids == self.image_token_id
        # The placeholder may lie outside the vocabulary: its embedding is never read.
        x = self.model.embed_tokens(jnp.where(is_image, 0, input_ids))
        if pixel_values is None:
            return x
        if layout is None:
            if pixel_values.ndim == 3:
                raise ValueError("per-row pixel_values [B, N, patch_dim] need their layout "
                                 "(models/qwen25_vl_vision.row_layouts).")  # fmt: skip
            if image_grid_thw is None or isinstance(image_grid_thw, jax.core.Tracer):
                raise ValueError(
                    "pixel_values need their image_grid_thw as host values (numpy), or the "
                    "tower's layout from vision_layout(image_grid_thw, config.vision)."
                )
            layout = vision_layout(image_grid_thw, self.config.vision, pixel_values.shape[0])
        tokens = self.visual(pixel_values, layout).astype(x.dtype)  # [(B,) N / merge^2, D]
        tokens = tokens.reshape(-1 if tokens.ndim == 3 else 1, *tokens.shape[-2:])
        flat = is_image.reshape(tokens.shape[0], -1)  # each row, or the whole batch
        order = jnp.clip(jnp.cumsum(flat, axis=1) - 1, 0, tokens.shape[1] - 1)
        soft = jnp.take_along_axis(tokens, order[..., None], axis=1).reshape(x.shape)
        return jnp.where(is_image[..., None], soft, x)

    def _positions(
        self, input_ids: Array, image_grid_thw: Any, positions: Any, segment_ids: Any,
        attention_mask: Any,
    ) -> tuple[Any, Array | None]:  # fmt: skip
        """[3, B, T] positions (numpy when known on the host) and the segments, padding
        folded in (models/masking.py)."""
        if positions is None and image_grid_thw is not None:
            concrete = not any(
                isinstance(a, jax.core.Tracer) for a in (input_ids, image_grid_thw, attention_mask)
            )
            if not concrete:
                raise ValueError(
                    "under jit, pass positions=rope_positions(input_ids, image_grid_thw, "
                    "config, attention_mask), computed on the host."
                )
            positions = rope_positions(input_ids, image_grid_thw, self.config, attention_mask)
        mrope = positions is not None and np.ndim(positions) == 3
        flat, segments = apply_padding_mask(
            attention_mask, input_ids, None if mrope else positions, segment_ids
        )
        if mrope:
            return positions, segments
        if flat is None:  # numpy: the rotary tables become constants of the program
            flat = np.arange(input_ids.shape[1], dtype=np.int32)[None]
        xp = np if isinstance(flat, np.ndarray) else jnp
        return xp.broadcast_to(flat[None], (3, *flat.shape)), segments

    def hidden_states(
        self,
        input_ids: Array,
        pixel_values: Array | None = None,
        image_grid_thw: Any = None,
        *,
        layout: VisionLayout | None = None,
        positions: Any = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        """The decoder's final-norm hidden states [B, T, D]. `positions`: [3, B, T] (M-RoPE,
        `rope_positions`) or [B, T] (text; packed rows with `segment_ids`)."""
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r} is not one of {REMAT_POLICIES}.")
        c = self.config
        x = self.embeddings(input_ids, pixel_values, image_grid_thw, layout)
        positions, segment_ids = self._positions(
            input_ids, image_grid_thw, positions, segment_ids, attention_mask
        )
        inv_freq = rope_inv_freq(c.text.head_dim, c.text.rope_theta, c.text.rope_scaling)
        cos, sin = mrope_cos_sin(positions, inv_freq, c.mrope_section, self.dtype)
        return self.model(x, cos, sin, segment_ids, remat_policy=self.remat_policy,
                          implementation=self.attention_implementation,
                          scan=self.scan_layers)  # fmt: skip

    def output_projection(self) -> Callable[[Array], Array]:
        """The output head as a pure function ``h [..., D] -> logits [..., vocab]``."""
        if self.lm_head is None:
            return output_head(self.model.embed_tokens.embedding[...], self.dtype, tied=True)
        return output_head(self.lm_head.kernel[...], self.dtype, tied=False)

    def __call__(
        self,
        input_ids: Array,
        pixel_values: Array | None = None,
        image_grid_thw: Any = None,
        *,
        layout: VisionLayout | None = None,
        positions: Any = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        h = self.hidden_states(
            input_ids, pixel_values, image_grid_thw, layout=layout, positions=positions,
            segment_ids=segment_ids, attention_mask=attention_mask,
        )  # fmt: skip
        return constrain(self.output_projection()(h), ACT_BTV)
