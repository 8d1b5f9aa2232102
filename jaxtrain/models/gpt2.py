"""GPT-2 in Flax NNX: learned positions, LayerNorm with bias, GELU MLP, fused q/k/v.

The attribute tree mirrors Hugging Face's GPT2LMHeadModel (transformer.wte, .wpe, .h[i].ln_1,
.attn.c_attn, .attn.c_proj, .ln_2, .mlp.c_fc, .mlp.c_proj, .ln_f); the output head is tied to
wte as in every GPT-2 checkpoint. No dropout: models train without it, as the Llama family.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config.tables import SCAN_LAYERS_DEFAULT
from jaxtrain.models.attention import causal_attention
from jaxtrain.models.blocks import GELU_ACTS, LayerNorm, gelu
from jaxtrain.models.initial_values import normal_param_values
from jaxtrain.models.layer_scan import run_layers
from jaxtrain.models.layers import Embedding, Projection, output_head
from jaxtrain.models.masking import apply_padding_mask
from jaxtrain.models.sharding import constrain

Array = jax.Array
DType = Any


@dataclass
class GPT2Config:
    """Architecture of a GPT-2 model (jaxtrain field names; the importer maps HF's n_embd...).

    ``intermediate_size=None`` means 4 * hidden_size (HF's n_inner=None).
    """

    vocab_size: int = 50257
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int | None = None
    max_position_embeddings: int = 1024
    hidden_act: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    bos_token_id: int | None = 50256
    eos_token_id: int | None = 50256
    pad_token_id: int | None = None
    model_type: str = "gpt2"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})."
            )
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.hidden_act not in GELU_ACTS:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not supported; use one of {sorted(GELU_ACTS)}."
            )
        if self.model_type != "gpt2":
            raise ValueError(f"GPT2Config needs model_type='gpt2', got {self.model_type!r}.")

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.to_dict().items())))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def mlp_matrices(self) -> int:
        """d x intermediate matrices per MLP (c_fc, c_proj), for the FLOPs count."""
        return 2

    def num_parameters(self) -> int:
        """Exact parameter count of GPT2LMHeadModel(self) (head tied to wte)."""
        d, f = self.hidden_size, self.intermediate_size
        layer = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
        embeddings = (self.vocab_size + self.max_position_embeddings) * d
        return embeddings + self.num_hidden_layers * layer + 2 * d

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPT2Config:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown GPT2Config field(s) {unknown}; known: {sorted(known)}.")
        return cls(**d)


class GPT2Attention(nnx.Module):
    def __init__(self, c: GPT2Config, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        n, h = c.num_attention_heads, c.head_dim
        self.c_attn = Projection(
            (c.hidden_size, 3, n, h),
            ("embed", "qkv", "heads", "head_dim"),
            "btd,dcnh->btcnh",
            bias_ndim=3,
            **kw,
        )
        # GPT-2 scales the residual projections' init by 1/sqrt(2 * layers).
        kw["std"] = c.initializer_range / (2 * c.num_hidden_layers) ** 0.5
        self.c_proj = Projection(
            (n, h, c.hidden_size),
            ("heads", "head_dim", "embed"),
            "btnh,nhd->btd",
            bias_ndim=1,
            **kw,
        )

    def project(self, x: Array) -> tuple[Array, Array, Array]:
        """q, k, v [B, T, N, H] (also used by the KV cache)."""
        qkv = self.c_attn(x)  # [B, T, 3, N, H]
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def __call__(self, x: Array, segment_ids: Array | None, implementation: str | None) -> Array:
        q, k, v = self.project(x)
        out = causal_attention(q, k, v, segment_ids=segment_ids, implementation=implementation)
        return self.c_proj(out)


class GPT2MLP(nnx.Module):
    def __init__(self, c: GPT2Config, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.act = c.hidden_act
        self.c_fc = Projection(
            (c.hidden_size, c.intermediate_size), ("embed", "mlp"), "btd,df->btf", bias_ndim=1, **kw
        )
        kw["std"] = c.initializer_range / (2 * c.num_hidden_layers) ** 0.5
        self.c_proj = Projection(
            (c.intermediate_size, c.hidden_size), ("mlp", "embed"), "btf,fd->btd", bias_ndim=1, **kw
        )

    def __call__(self, x: Array) -> Array:
        return self.c_proj(gelu(self.c_fc(x), self.act))


class GPT2Block(nnx.Module):
    def __init__(self, c: GPT2Config, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        norm = dict(eps=c.layer_norm_epsilon, dtype=dtype, param_dtype=param_dtype)
        self.ln_1 = LayerNorm(c.hidden_size, **norm)
        self.attn = GPT2Attention(c, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ln_2 = LayerNorm(c.hidden_size, **norm)
        self.mlp = GPT2MLP(c, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: Array, segment_ids: Array | None, implementation: str | None) -> Array:
        x = x + self.attn(self.ln_1(x), segment_ids, implementation)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nnx.Module):
    def __init__(self, c: GPT2Config, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        kw = dict(std=c.initializer_range, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.wte = Embedding(c.vocab_size, c.hidden_size, **kw)
        self.wpe = nnx.Param(
            normal_param_values(rngs, (c.max_position_embeddings, c.hidden_size), 0.01,
                                param_dtype),
            logical_axes=(None, "embed"),
        )  # fmt: skip
        self.dtype = dtype
        self.h = nnx.List(
            [GPT2Block(c, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
             for _ in range(c.num_hidden_layers)]
        )  # fmt: skip
        self.ln_f = LayerNorm(
            c.hidden_size, eps=c.layer_norm_epsilon, dtype=dtype, param_dtype=param_dtype
        )

    def embed(self, input_ids: Array, positions: Array) -> Array:
        """Token plus learned position embeddings [B, T, D]."""
        return self.wte(input_ids) + jnp.take(self.wpe[...], positions, axis=0).astype(self.dtype)


class GPT2LMHeadModel(nnx.Module):
    """GPT-2 LM. ``model(input_ids, positions=None, segment_ids=None, attention_mask=None)``
    -> logits [B, T, vocab]; same call conventions as LlamaForCausalLM."""

    def __init__(
        self,
        config: GPT2Config,
        *,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if not isinstance(config, GPT2Config):
            raise ValueError(f"config must be a GPT2Config, got {type(config).__name__}.")
        self.config = config
        self.dtype = dtype
        self.attention_implementation: str | None = None
        # The blocks under one jax.lax.scan (models/layer_scan.py), as LlamaForCausalLM's.
        self.scan_layers = SCAN_LAYERS_DEFAULT
        self.transformer = GPT2Model(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def hidden_states(
        self,
        input_ids: Array,
        *,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}.")
        b, t = input_ids.shape
        if t > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {t} exceeds max_position_embeddings "
                f"({self.config.max_position_embeddings}) of this GPT-2; use shorter sequences."
            )
        positions, segment_ids = apply_padding_mask(
            attention_mask, input_ids, positions, segment_ids
        )
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        m = self.transformer
        x = constrain(m.embed(input_ids, positions), ("batch", "length", "embed"))
        implementation = self.attention_implementation

        def step(block: nnx.Module, x: Array, segment_ids: Array | None) -> tuple[Array, None]:
            return constrain(
                block(x, segment_ids, implementation), ("batch", "length", "embed")
            ), None

        x, _ = run_layers(m.h, step, x, segment_ids, scan=self.scan_layers)
        return m.ln_f(x)

    def output_projection(self):
        """The tied output head as a pure function h [..., D] -> logits [..., vocab]."""
        return output_head(self.transformer.wte.embedding[...], self.dtype, tied=True)

    def __call__(
        self,
        input_ids: Array,
        *,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        h = self.hidden_states(
            input_ids, positions=positions, segment_ids=segment_ids, attention_mask=attention_mask
        )
        return constrain(self.transformer.wte.attend(h), ("batch", "length", "vocab"))
