"""Gemma 2 and Gemma 3 (text) decoders in Flax NNX.

What Gemma changes against Llama: embeddings scaled by sqrt(hidden_size); RMSNorm that scales
by (1 + w) (weights start at 0); GeGLU (tanh-approximated GELU gate) MLPs; a norm after the
attention and after the MLP as well as before each; queries scaled by
query_pre_attn_scalar^-1/2; attention logits soft-capped (Gemma 2: cap * tanh(x / cap)) and
the final logits too; per-layer attention kinds (``layer_types``: sliding-window or full).
Gemma 3 adds q/k RMSNorm and a separate rotary base for its sliding layers
(``rope_local_base_freq``) and drops the soft-capping.

Attention is ``attention.causal_attention`` with Gemma's scale and logit soft-capping
(dense einsums for short rows, blockwise for long ones; "cudnn" falls back to them when
soft-capping is on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.attention import causal_attention
from jaxtrain.models.blocks import gated, gelu_tanh
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.elementwise import apply_rope
from jaxtrain.models.layer_scan import LayerStep, run_layers
from jaxtrain.models.layers import Embedding, Projection, rope_cos_sin, rope_inv_freq
from jaxtrain.models.llama import ACT_BTD, ACT_BTV, LlamaForCausalLM
from jaxtrain.models.sharding import constrain

Array = jax.Array
DType = Any

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GemmaConfig(LlamaConfig):
    """A LlamaConfig plus Gemma's fields (HF names). ``layer_types`` (one per layer) says
    which layers use ``sliding_window``; None alternates sliding/full (Gemma 2)."""

    SUPPORTED_MODEL_TYPES: ClassVar[tuple[str, ...]] = GEMMA_MODEL_TYPES
    SUPPORTED_HIDDEN_ACTS: ClassVar[tuple[str, ...]] = ("gelu_pytorch_tanh",)

    hidden_act: str = "gelu_pytorch_tanh"
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_types: list[str] | None = field(default=None)
    rope_local_base_freq: float | None = None
    tie_word_embeddings: bool = True
    model_type: str = "gemma2"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(
            LAYER_TYPES
        ):
            raise ValueError(
                f"layer_types must name one of {LAYER_TYPES} per layer "
                f"({self.num_hidden_layers}), got {self.layer_types!r}."
            )
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers: set sliding_window.")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}.")
        if self.model_type == "gemma2" and self.qk_norm:
            raise ValueError("gemma2 has no q/k norm; qk_norm is a gemma3_text feature.")

    __hash__ = LlamaConfig.__hash__

    def num_parameters(self) -> int:
        """Exact parameter count of GemmaForCausalLM built from this config."""
        return super().num_parameters() + 2 * self.num_hidden_layers * self.hidden_size


class GemmaRMSNorm(nnx.Module):
    """RMSNorm scaling by (1 + w), all in float32 (as HF computes it), cast at the end."""

    def __init__(self, dim: int, *, eps: float, dtype: DType, param_dtype: DType,
                 axis: str = "embed"):  # fmt: skip
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(jnp.zeros((dim,), param_dtype), logical_axes=(axis,))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(self.dtype)


def softcap(x: Array, cap: float | None) -> Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


class GemmaAttention(nnx.Module):
    def __init__(self, config: GemmaConfig, layer: int, *, dtype: DType, param_dtype: DType,
                 rngs: nnx.Rngs):  # fmt: skip
        c = config
        self.g = c.num_queries_per_kv
        self.head_dim = c.head_dim
        self.scale = float(c.query_pre_attn_scalar) ** -0.5
        self.cap = c.attn_logit_softcapping
        sliding = c.layer_types[layer] == "sliding_attention"
        self.window = c.sliding_window if sliding else None
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qkv_proj = Projection(
            (c.hidden_size, c.num_key_value_heads, self.g + 2, c.head_dim),
            ("embed", "kv_heads", "qkv", "head_dim"), "btd,dkgh->btkgh",
            bias_ndim=3 if c.attention_bias else None, **kw,
        )  # fmt: skip
        self.o_proj = Projection(
            (c.num_attention_heads, c.head_dim, c.hidden_size),
            ("heads", "head_dim", "embed"), "btnh,nhd->btd", **kw,
        )  # fmt: skip
        if c.qk_norm:
            norm_kw = dict(eps=c.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.q_norm = GemmaRMSNorm(c.head_dim, axis="head_dim", **norm_kw)
            self.k_norm = GemmaRMSNorm(c.head_dim, axis="head_dim", **norm_kw)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """q [B, T, N, H] and k, v [B, T, K, H], q and k normed and rotated (also used by
        the KV cache)."""
        b, t = x.shape[:2]
        g = self.g
        qkv = self.qkv_proj(x)  # [B, T, K, G + 2, H]
        q, k, v = qkv[..., :g, :], qkv[..., g, :], qkv[..., g + 1, :]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin).reshape(b, t, -1, self.head_dim)
        return q, apply_rope(k, cos, sin), v

    def __call__(
        self,
        x: Array,
        cos: Array,
        sin: Array,
        segment_ids: Array | None,
        implementation: str | None = None,
        bidirectional_ids: Array | None = None,
    ) -> Array:
        q, k, v = self.project(x, cos, sin)
        if implementation == "cudnn" and self.cap is not None:
            implementation = None  # the fused kernel cannot soft-cap: the einsum path can
        out = causal_attention(
            q, k, v, segment_ids=segment_ids, sliding_window=self.window,
            implementation=implementation, scale=self.scale, logit_cap=self.cap,
            bidirectional_ids=bidirectional_ids,
        )  # fmt: skip
        return self.o_proj(out)


class GemmaMLP(nnx.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)), gate and up fused as in the Llama MLP."""

    def __init__(self, config: GemmaConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        c = config
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_up_proj = Projection(
            (c.hidden_size, 2, c.intermediate_size), ("embed", "gate_up", "mlp"),
            "btd,dcf->btcf", **kw,
        )  # fmt: skip
        self.down_proj = Projection(
            (c.intermediate_size, c.hidden_size), ("mlp", "embed"), "btf,fd->btd", **kw
        )

    def __call__(self, x: Array) -> Array:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(gated(gelu_tanh, gate_up[..., 0, :], gate_up[..., 1, :]))


class GemmaDecoderLayer(nnx.Module):
    def __init__(self, config: GemmaConfig, layer: int, *, dtype: DType, param_dtype: DType,
                 rngs: nnx.Rngs):  # fmt: skip
        norm = dict(eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        d = config.hidden_size
        self.sliding = config.layer_types[layer] == "sliding_attention"
        self.input_layernorm = GemmaRMSNorm(d, **norm)
        self.self_attn = GemmaAttention(config, layer, dtype=dtype, param_dtype=param_dtype,
                                        rngs=rngs)  # fmt: skip
        self.post_attention_layernorm = GemmaRMSNorm(d, **norm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, **norm)
        self.mlp = GemmaMLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, **norm)

    def __call__(self, x, cos, sin, segment_ids, implementation=None, bidirectional_ids=None):
        h = self.self_attn(
            self.input_layernorm(x), cos, sin, segment_ids, implementation, bidirectional_ids
        )
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


def layer_step(implementation: str | None) -> LayerStep:
    """A Gemma layer as a `run_layers` step; its inputs are the rotary tables of sliding and
    of full layers, segment_ids and bidirectional_ids. A layer picks its table by its static
    `sliding`, so a sliding layer and a full one are different modules to the scan."""

    def step(layer: GemmaDecoderLayer, x: Array, inputs: tuple[Any, ...]) -> tuple[Array, None]:
        tables, segment_ids, bidirectional_ids = inputs
        cos, sin = tables[layer.sliding]
        x = layer(x, cos, sin, segment_ids, implementation, bidirectional_ids)
        return constrain(x, ACT_BTD), None

    return step


class GemmaModel(nnx.Module):
    def __init__(self, config: GemmaConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, std=config.initializer_range,
            dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.layers = nnx.List(
            [
                GemmaDecoderLayer(config, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = GemmaRMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype
        )

    def embed(self, input_ids: Array) -> Array:
        """Token embeddings scaled by sqrt(hidden_size), as Gemma's decoder starts."""
        return self.embed_tokens(input_ids) * jnp.asarray(self.config.hidden_size**0.5, self.dtype)

    def rope_tables(self, positions: Array) -> dict[bool, tuple[Array, Array]]:
        """(cos, sin) for the sliding layers (key True) and the full ones (key False): Gemma 3
        rotates its sliding layers with their own base."""
        c = self.config
        full = rope_cos_sin(positions, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling),
                            self.dtype)  # fmt: skip
        local = full
        if c.rope_local_base_freq is not None:
            inv = rope_inv_freq(c.head_dim, c.rope_local_base_freq, None)
            local = rope_cos_sin(positions, inv, self.dtype)
        return {True: local, False: full}

    def __call__(self, input_ids, positions, segment_ids=None, *, remat_policy="none",
                 implementation=None, embeddings=None, bidirectional_ids=None,
                 scan=False):  # fmt: skip
        """Final-norm hidden states; `embeddings` [B, T, D] replace the token embeddings
        (an image's tokens in them: Gemma 3's vision model), `bidirectional_ids` as in
        attention.causal_attention."""
        tables = self.rope_tables(positions)
        x = self.embed(input_ids) if embeddings is None else embeddings
        x = constrain(x, ACT_BTD)
        x, _ = run_layers(
            self.layers, layer_step(implementation), x,
            (tables, segment_ids, bidirectional_ids), scan=scan, remat_policy=remat_policy,
        )  # fmt: skip
        return self.norm(x)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text decoder; logits soft-capped by ``final_logit_softcapping``."""

    decoder_class = GemmaModel

    def __init__(self, config: GemmaConfig, **kwargs: Any):
        if not isinstance(config, GemmaConfig):
            raise ValueError(
                f"config must be a GemmaConfig, got {type(config).__name__}; build one with "
                "GemmaConfig(...) or GemmaConfig.from_dict(d)."
            )
        super().__init__(config, **kwargs)

    def output_projection(self):
        project = super().output_projection()
        cap = self.config.final_logit_softcapping
        return project if cap is None else (lambda h: softcap(project(h), cap))

    def __call__(self, input_ids: Array, **kwargs: Any) -> Array:
        h = self.hidden_states(input_ids, **kwargs)
        return constrain(self.output_projection()(h), ACT_BTV)
