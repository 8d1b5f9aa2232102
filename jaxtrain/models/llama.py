"""LlamaForCausalLM in Flax NNX (Llama 2/3, Mistral sliding window, Qwen2 q/k/v bias,
Qwen3 q/k norm).

The attribute tree mirrors Hugging Face (model.embed_tokens, model.layers[i].self_attn,
.mlp, .input_layernorm, .post_attention_layernorm, model.norm, lm_head) so weight import is
a rename plus reshape; q/k/v and gate/up are fused (see layers.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.config.tables import REMAT_POLICIES, SCAN_LAYERS_DEFAULT
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.elementwise import add_rms_norm
from jaxtrain.models.layer_scan import LayerStep, run_layers
from jaxtrain.models.layers import (
    MLP,
    Attention,
    Embedding,
    Projection,
    RMSNorm,
    output_head,
    rope_cos_sin,
    rope_inv_freq,
)
from jaxtrain.models.masking import apply_padding_mask
from jaxtrain.models.sharding import constrain
from jaxtrain.pytrees import path_str

Array = jax.Array
DType = Any

# Logical names of activation dims for the sharding constraints (see models/sharding.py).
ACT_BTD = ("batch", "length", "embed")
ACT_BTV = ("batch", "length", "vocab")


class DecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        norm_kw = dict(eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm_kw)
        self.self_attn = Attention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm_kw)
        self.mlp = MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.elementwise_kernels = "xla"  # set by a run's elementwise_kernels (elementwise.py)

    def __call__(
        self,
        x: Array,
        cos: Array,
        sin: Array,
        segment_ids: Array | None = None,
        implementation: str | None = None,
    ) -> Array:
        h = self.self_attn(self.input_layernorm(x), cos, sin, segment_ids, implementation)
        norm = self.post_attention_layernorm
        # The residual add and the MLP's norm in one pass (a kernel of its own on a GPU).
        x, normed = add_rms_norm(x, h, norm.weight[...], eps=norm.eps, dtype=norm.dtype,
                                 kernel=self.elementwise_kernels)  # fmt: skip
        return x + self.mlp(normed)


def layer_step(implementation: str | None) -> LayerStep:
    """A decoder layer as a `run_layers` step; its inputs are (cos, sin, segment_ids)."""

    def step(layer: nnx.Module, x: Array, inputs: tuple[Array, ...]) -> tuple[Array, None]:
        return constrain(layer(x, *inputs, implementation), ACT_BTD), None

    return step


class LlamaModel(nnx.Module):
    """The decoder stack without the output head (HF's ``LlamaModel``)."""

    def __init__(self, config: LlamaConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.embed_tokens = Embedding(
            config.vocab_size,
            config.hidden_size,
            std=config.initializer_range,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.layers = nnx.List(
            [
                DecoderLayer(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                for _ in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype
        )

    def __call__(
        self,
        input_ids: Array,
        positions: Array,
        segment_ids: Array | None = None,
        *,
        remat_policy: str = "none",
        implementation: str | None = None,
        scan: bool = False,
    ) -> Array:
        c = self.config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        cos, sin = rope_cos_sin(positions, inv_freq, self.dtype)  # shared by all layers
        x = constrain(self.embed_tokens(input_ids), ACT_BTD)
        x, _ = run_layers(
            self.layers, layer_step(implementation), x, (cos, sin, segment_ids),
            scan=scan, remat_policy=remat_policy,
        )  # fmt: skip
        return self.norm(x)


class LlamaForCausalLM(nnx.Module):
    """Decoder-only LM. ``model(input_ids, positions=None, segment_ids=None)`` -> logits.

    Attributes read at call time (plain Python values, part of the static graph):
    - ``remat_policy``: one of REMAT_POLICIES; rematerialises each decoder layer.
    - ``scan_layers``: run the decoder layers under one ``jax.lax.scan`` (models/layer_scan.py:
      each layer is traced and compiled once, not once per layer; same parameters, same
      result); False loops over them.
    - ``attention_implementation``: "xla" (``attention.grouped_attention``: einsums,
      softmax in float32), "blockwise" (models/blockwise.py: no T x T scores; ring
      attention over the sp mesh axis), "cudnn" (``jax.nn.dot_product_attention``'s fused
      GPU kernel) or None (``attention.default_implementation``: cuDNN on NVIDIA GPUs where
      it applies, else blockwise from ``attention.BLOCKWISE_MIN_LENGTH`` tokens on, "xla" below).
    """

    # The decoder stack; families that change only the layers (models/moe.py) replace it.
    decoder_class: type[nnx.Module] = LlamaModel

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: DType = jnp.float32,
        param_dtype: DType = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if not isinstance(config, LlamaConfig):
            raise ValueError(
                f"config must be a LlamaConfig, got {type(config).__name__}; build one with "
                "LlamaConfig(...) or LlamaConfig.from_dict(d)."
            )
        self.config = config
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.remat_policy = "none"
        self.scan_layers = SCAN_LAYERS_DEFAULT
        self.attention_implementation: str | None = None
        self.model = self.decoder_class(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Projection(
                (config.hidden_size, config.vocab_size),
                ("embed", "vocab"),
                "btd,dv->btv",
                std=config.initializer_range,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )

    def __call__(
        self,
        input_ids: Array,
        *,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
    ) -> Array:
        """input_ids [B, T] int -> logits [B, T, vocab] in the compute dtype.

        positions [B, T] default to 0..T-1 per row; with packing pass per-document
        positions together with ``segment_ids`` so each document restarts at 0.
        ``attention_mask`` [B, T] (1 real, 0 padding): padding is never attended to and,
        without explicit positions, each row's real tokens are numbered from 0 (so a
        left-padded row's logits equal the unpadded row's; see models/masking.py).
        """
        h = self.hidden_states(
            input_ids, positions=positions, segment_ids=segment_ids, attention_mask=attention_mask
        )
        return constrain(self.output_projection()(h), ACT_BTV)

    def output_projection(self) -> Callable[[Array], Array]:
        """The output head as a pure function ``h [..., D] -> logits [..., vocab]`` over the
        head's weights: the model's logits, and losses that compute them a chunk at a time."""
        if self.lm_head is None:
            return output_head(self.model.embed_tokens.embedding[...], self.dtype, tied=True)
        return output_head(self.lm_head.kernel[...], self.dtype, tied=False)

    def hidden_states(
        self,
        input_ids: Array,
        *,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        attention_mask: Array | None = None,
        **decoder_inputs: Array,
    ) -> Array:
        """The final-norm hidden states [B, T, hidden] that the output head turns into logits.
        `decoder_inputs`: what a family's decoder takes besides (a MoE's `routing`)."""
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"remat_policy={self.remat_policy!r} is not one of {REMAT_POLICIES}; "
                "set model.remat_policy to one of them."
            )
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}.")
        t = input_ids.shape[1]
        warn_past_context(self.config, t)
        positions, segment_ids = apply_padding_mask(
            attention_mask, input_ids, positions, segment_ids
        )
        if positions is None:  # numpy: the rotary tables become constants of the program
            positions = np.arange(t, dtype=np.int32)[None]
        return self.model(
            input_ids,
            positions,
            segment_ids,
            remat_policy=self.remat_policy,
            implementation=self.attention_implementation,
            scan=self.scan_layers,
            **decoder_inputs,
        )


# Configs already warned about rows past their pretrained context (once per config).
_WARNED_CONTEXT: set[tuple[int, int]] = set()


def warn_past_context(config: LlamaConfig, length: int) -> None:
    """Warn once per config when a row is longer than ``max_position_embeddings``: rotary
    positions (and their linear / Llama-3 scalings) still compute, but the model was not
    pretrained that far, so quality past it needs long-context fine-tuning."""
    limit = config.max_position_embeddings
    if length <= limit or (id(config), limit) in _WARNED_CONTEXT:
        return
    _WARNED_CONTEXT.add((id(config), limit))
    warnings.warn(
        f"rows of {length} tokens exceed max_position_embeddings={limit}: positions past "
        f"{limit} were not seen in pretraining (rope_scaling={config.rope_scaling}).",
        stacklevel=3,
    )


def logical_axes(state_or_model: nnx.State | nnx.Module) -> nnx.State:
    """Logical-axis tuples for every nnx.Param, in a State shaped like the Param State.

    Accepts a module (its Params are taken) or a State whose leaves are nnx.Variables.
    The tuples are pytree nodes themselves: map over them with
    ``jax.tree.map(f, params, axes, is_leaf=lambda x: isinstance(x, nnx.Variable))``
    (params first), or flatten with ``is_leaf=lambda x: isinstance(x, tuple)``.
    """
    if isinstance(state_or_model, nnx.Module):
        state = nnx.state(state_or_model, nnx.Param)
    else:
        state = state_or_model

    def axes_of(path: tuple[Any, ...], var: Any) -> tuple[str | None, ...]:
        name = path_str(path)
        if not isinstance(var, nnx.Variable):
            raise ValueError(
                f"logical_axes: leaf {name!r} is a {type(var).__name__}, not an nnx.Variable; "
                "pass the model or the State from nnx.split/nnx.state, not raw arrays."
            )
        axes = var.get_metadata().get("logical_axes")
        ndim = len(var.shape) if hasattr(var, "shape") else jnp.ndim(var[...])
        if axes is None or len(axes) != ndim:
            raise ValueError(
                f"logical_axes: parameter {name!r} of shape {tuple(var.shape)} has "
                f"logical_axes={axes!r}; create it as nnx.Param(value, logical_axes=(...)) with "
                "one name (or None) per dimension."
            )
        return tuple(axes)

    return jax.tree_util.tree_map_with_path(
        axes_of, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
