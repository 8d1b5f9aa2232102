"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE) in Flax NNX.

A MoE model is a Llama-family model whose MLPs are (on the sparse layers) a
``SparseMoeBlock``: a softmax router picks ``num_experts_per_tok`` of ``num_experts`` SwiGLU
experts per token, whose outputs are summed with the routing weights; Qwen2-MoE adds an
always-on shared expert scaled by a sigmoid gate. Token dispatch is exact and dropless by
default (see moe_dispatch.py); ``capacity_factor`` bounds the rows per expert instead.

Expert weights carry the ``expert`` logical axis, which the default rules map to the ``ep``
mesh axis: with ep > 1 each device holds E / ep experts and computes only their rows (a
shard_map over the mesh; the partial outputs are summed over ep). Tokens stay split over
dp/fsdp/sp as everywhere else, so attention is replicated over ep.

The router's load-balancing loss and z-loss are returned next to the hidden states
(``return_aux=True``); the Trainer's default causal-LM loss adds them, weighted by
``router_aux_loss_coef`` and ``router_z_loss_coef``, and logs them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.initial_values import normal_param_values
from jaxtrain.models.layer_scan import LayerStep, run_layers
from jaxtrain.models.layers import (
    MLP,
    Attention,
    Embedding,
    Projection,
    RMSNorm,
    rope_cos_sin,
    rope_inv_freq,
)
from jaxtrain.models.llama import (
    ACT_BTD,
    ACT_BTV,
    DecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)
from jaxtrain.models.moe_dispatch import (
    IMPLEMENTATIONS,
    PALLAS_IMPLEMENTATIONS,
    expert_mlp,
    route,
    router_losses,
)
from jaxtrain.models.sharding import constrain, current_rules

Array = jax.Array
DType = Any

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass
class MoeConfig(LlamaConfig):
    """A LlamaConfig plus the mixture-of-experts fields (HF names where HF has them).

    - ``moe_intermediate_size``: each expert's hidden size (None: ``intermediate_size``,
      Mixtral's convention); ``intermediate_size`` stays the size of dense layers.
    - ``shared_expert_intermediate_size``: 0 for none (Qwen2-MoE has one, sigmoid-gated).
    - ``norm_topk_prob``: rescale the top-k probabilities to sum to 1 (Mixtral: always).
    - ``decoder_sparse_step`` / ``mlp_only_layers``: layer i is sparse when
      ``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers`` (Qwen).
    - ``router_aux_loss_coef`` / ``router_z_loss_coef``: weights of the two router losses.
    - ``capacity_factor``: None is dropless; c keeps at most ceil(c * tokens * k / E) rows
      per expert and layer (earliest tokens first) and drops the others' expert output.
    - ``moe_implementation``: None (blocks on CPU, pallas on NVIDIA GPUs from Ampere on,
      ragged_dot elsewhere), "blocks", "ragged_dot", "pallas" (GPU/TPU kernels,
      models/moe_kernels.py), "interpret" and "interpret_tpu" (those kernels' code
      interpreted, for tests) -- all exact.
    """

    SUPPORTED_MODEL_TYPES: ClassVar[tuple[str, ...]] = MOE_MODEL_TYPES

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0
    capacity_factor: float | None = None
    moe_implementation: str | None = None
    model_type: str = "mixtral"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "num_experts_per_tok", "decoder_sparse_step"):
            _positive_int(name, getattr(self, name))
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        _positive_int("moe_intermediate_size", self.moe_intermediate_size)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                f"({self.num_experts}); route each token to at most num_experts experts."
            )
        size = self.shared_expert_intermediate_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(
                f"shared_expert_intermediate_size must be an integer >= 0 (0: no shared "
                f"expert), got {size!r}."
            )
        layers = self.mlp_only_layers
        if isinstance(layers, str):  # from the command line: "1,3" or "[1, 3]"
            layers = [p for p in layers.strip("[]() ").replace(",", " ").split()]
        try:
            self.mlp_only_layers = [int(i) for i in layers]
        except (TypeError, ValueError):
            raise ValueError(
                f"mlp_only_layers must be a list of layer indices, got {self.mlp_only_layers!r}."
            ) from None
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(
                f"mlp_only_layers {bad} are not layers of a {self.num_hidden_layers}-layer model."
            )
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}.")
        if self.capacity_factor is not None and not (
            isinstance(self.capacity_factor, (int, float)) and self.capacity_factor > 0
        ):
            raise ValueError(
                f"capacity_factor must be None (dropless) or a number > 0, got "
                f"{self.capacity_factor!r}."
            )
        if self.moe_implementation not in (None, *IMPLEMENTATIONS):
            raise ValueError(
                f"moe_implementation={self.moe_implementation!r} is not one of "
                f"{(None, *IMPLEMENTATIONS)}."
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"norm_topk_prob must be True or False, got {self.norm_topk_prob!r}.")

    __hash__ = LlamaConfig.__hash__

    def is_sparse_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.is_sparse_layer(i) for i in range(self.num_hidden_layers))

    @property
    def routing_shape(self) -> tuple[int, int]:
        """(sparse layers, experts per token): a token's routing, as MoeModel returns and
        replays it."""
        return self.num_sparse_layers, self.num_experts_per_tok

    def _mlp_parameters(self, active: bool) -> int:
        """Parameters of all MLP blocks (active: those one token multiplies by)."""
        d = self.hidden_size
        experts = self.num_experts_per_tok if active else self.num_experts
        shared = self.shared_expert_intermediate_size
        sparse = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
        if shared:
            sparse += 3 * d * shared + d  # the shared expert and its sigmoid gate
        dense = 3 * d * self.intermediate_size + (
            (2 * self.intermediate_size + d) if self.mlp_bias else 0
        )
        n_sparse = self.num_sparse_layers
        return n_sparse * sparse + (self.num_hidden_layers - n_sparse) * dense

    def num_parameters(self) -> int:
        """Exact parameter count of MoeForCausalLM built from this config."""
        dense_mlp = 3 * self.hidden_size * self.intermediate_size + (
            (2 * self.intermediate_size + self.hidden_size) if self.mlp_bias else 0
        )
        without_mlps = super().num_parameters() - self.num_hidden_layers * dense_mlp
        return without_mlps + self._mlp_parameters(active=False)

    def active_mlp_matmul_parameters(self) -> int:
        """MLP weights one token is multiplied by, summed over layers (for FLOPs/MFU)."""
        return self._mlp_parameters(active=True)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class RouterOutput(NamedTuple):
    """What a sparse layer's router did: its losses [balance, z] and each token's experts
    [B, T, k]."""

    stats: Array
    experts: Array


class SparseMoeBlock(nnx.Module):
    """Router + experts (+ optional gated shared expert). ``block(x) -> (y, [balance, z])``."""

    # The stacked per-expert kernels [experts, inputs, ...outputs]: a QLoRA base stores them
    # quantized like the projections' (quantization/kernel.py), read with `[...]` either way.
    expert_kernels = ("gate_up", "down")

    def __init__(self, config: MoeConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        c = config
        e, d, f = c.num_experts, c.hidden_size, c.moe_intermediate_size
        std = c.initializer_range
        self.num_experts = e
        self.top_k = c.num_experts_per_tok
        self.normalize = c.norm_topk_prob
        self.capacity_factor = c.capacity_factor
        self.implementation = c.moe_implementation
        self.dtype = dtype
        # The router runs in float32: its softmax and top-k decide which weights train.
        self.gate = Projection(
            (d, e), ("embed", None), "btd,de->bte",
            std=std, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        self.gate_up = nnx.Param(
            normal_param_values(rngs, (e, d, 2, f), std, param_dtype),
            logical_axes=("expert", "embed", "gate_up", "mlp"),
        )
        self.down = nnx.Param(
            normal_param_values(rngs, (e, f, d), std, param_dtype),
            logical_axes=("expert", "mlp", "embed"),
        )
        if c.shared_expert_intermediate_size:
            shared = dataclasses.replace(c, intermediate_size=c.shared_expert_intermediate_size)
            self.shared_expert = MLP(shared, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            self.shared_expert_gate = Projection(
                (d, 1), ("embed", None), "btd,do->bto",
                std=std, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
            )  # fmt: skip
        else:
            self.shared_expert = self.shared_expert_gate = None

    def __call__(self, x: Array, replay: Array | None = None) -> tuple[Array, RouterOutput]:
        """(y [B, T, D], the router's statistics and the experts each token went to).
        `replay` [B, T, k]: experts to route to instead of this router's top k (moe_dispatch.route)."""
        b, t, d = x.shape
        logits = self.gate(x).reshape(b * t, self.num_experts)
        replayed = None if replay is None else replay.reshape(b * t, -1)
        weights, experts, _ = route(logits, self.top_k, normalize=self.normalize, replay=replayed)
        balance, z = router_losses(logits, experts, self.num_experts)
        y = self.experts(x, experts.reshape(b, t, -1), weights.reshape(b, t, -1))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            y = y + jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
        return y, RouterOutput(jnp.stack([balance, z]), experts.reshape(b, t, -1))

    def experts(self, x: Array, experts: Array, weights: Array) -> Array:
        """The routed experts' weighted sum [B, T, D]; split over ep under a sharded trace."""
        gate_up, down = self.gate_up[...], self.down[...]
        kw = dict(
            num_experts=self.num_experts,
            capacity_factor=self.capacity_factor,
            implementation=self.implementation,
        )
        rules = current_rules()
        ep = 1 if rules is None else rules.mesh.shape["ep"]
        # A Pallas kernel has no sharding rule (XLA would gather its operands onto every
        # device): on a mesh it runs per device under shard_map, even without ep.
        if rules is None or (ep == 1 and self.implementation not in PALLAS_IMPLEMENTATIONS):
            b, t, d = x.shape
            flat = expert_mlp(
                x.reshape(b * t, d), experts.reshape(b * t, -1), weights.reshape(b * t, -1),
                gate_up, down, **kw,
            )  # fmt: skip
            return flat.reshape(b, t, d)
        if self.num_experts % ep:
            raise ValueError(
                f"num_experts={self.num_experts} cannot be split over ep={ep} devices; choose "
                "an ep that divides the number of experts."
            )
        local = self.num_experts // ep
        x_spec = rules.activation_spec(x.shape, ("batch", "length", None))
        route_spec = P(x_spec[0], x_spec[1], None)

        def shard(x, experts, weights, gate_up, down):
            # Every device of an ep group sees the same tokens; it computes the rows routed
            # to its own experts, and the ep partial sums are added outside.
            b, t, d = x.shape
            first = jax.lax.axis_index("ep") * local
            flat = expert_mlp(
                x.reshape(b * t, d), experts.reshape(b * t, -1), weights.reshape(b * t, -1),
                gate_up, down, first_expert=first, **kw,
            )  # fmt: skip
            return flat.reshape(1, b, t, d)

        partial = jax.shard_map(
            shard,
            mesh=rules.mesh,
            in_specs=(x_spec, route_spec, route_spec, P("ep"), P("ep")),
            out_specs=P("ep", *x_spec),
            check_vma=False,
        )(x, experts, weights, gate_up, down)
        return jnp.sum(partial, axis=0)


class MoeDecoderLayer(DecoderLayer):
    """A Llama decoder layer whose MLP is a SparseMoeBlock; returns (x, router stats)."""

    def __init__(self, config: MoeConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        norm_kw = dict(eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, **norm_kw)
        self.self_attn = Attention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, **norm_kw)
        self.mlp = SparseMoeBlock(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cos, sin, segment_ids=None, implementation=None, replay=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segment_ids, implementation)
        y, router = self.mlp(self.post_attention_layernorm(x), replay)
        return x + y, router


def layer_step(implementation: str | None, replayed: bool = False) -> LayerStep:
    """A layer (sparse or dense) as a `run_layers` step; aux: a sparse layer's RouterOutput,
    None for a dense layer. `replayed`: the step's inputs are (shared inputs, the layer's
    routing to replay) (`run_layers`' layer_inputs)."""

    def step(layer: nnx.Module, x: Array, inputs: tuple[Any, ...]) -> tuple[Array, Any]:
        shared, replay = inputs if replayed else (inputs, None)
        if isinstance(layer, MoeDecoderLayer):
            x, router = layer(x, *shared, implementation, replay)
        else:
            x, router = layer(x, *shared, implementation), None
        return constrain(x, ACT_BTD), router

    return step


class MoeModel(LlamaModel):
    """The decoder stack; ``__call__`` returns (hidden states, router losses dict)."""

    def __init__(self, config: MoeConfig, *, dtype: DType, param_dtype: DType, rngs: nnx.Rngs):
        self.config = config
        self.dtype = dtype
        self.embed_tokens = Embedding(
            config.vocab_size, config.hidden_size, std=config.initializer_range,
            dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        )  # fmt: skip
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List(
            [
                MoeDecoderLayer(config, **kw) if config.is_sparse_layer(i) else DecoderLayer(config, **kw)
                for i in range(config.num_hidden_layers)
            ]
        )  # fmt: skip
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
        routing: Array | None = None,
    ) -> tuple[Array, dict[str, Array]]:
        """(hidden states, aux): aux holds the router losses and "routing" [B, S, T, k], the
        experts each token went to in each of the S sparse layers. `routing` (the same
        shape, -1 where nothing was recorded): experts to replay instead of choosing."""
        c = self.config
        inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        cos, sin = rope_cos_sin(positions, inv_freq, self.dtype)
        x = constrain(self.embed_tokens(input_ids), ACT_BTD)
        replays = None if routing is None else self.layer_routing(routing)
        x, per_layer = run_layers(
            self.layers, layer_step(implementation, replays is not None), x,
            (cos, sin, segment_ids), scan=scan, remat_policy=remat_policy, layer_inputs=replays,
        )  # fmt: skip
        routers = [r for r in per_layer if r is not None]
        stats = [r.stats for r in routers]
        mean = jnp.mean(jnp.stack(stats), axis=0) if stats else jnp.zeros((2,), jnp.float32)
        aux = {
            "aux_loss": c.router_aux_loss_coef * mean[0] + c.router_z_loss_coef * mean[1],
            "router_balance": mean[0],
            "router_z": mean[1],
        }
        if routers:
            aux["routing"] = jnp.stack([r.experts for r in routers], axis=1)
        return self.norm(x), aux

    def layer_routing(self, routing: Array) -> list[Array | None]:
        """Each layer's slice [B, T, k] of `routing` [B, S, T, k] (None for a dense layer)."""
        sparse = [i for i in range(len(self.layers)) if self.config.is_sparse_layer(i)]
        if routing.ndim != 4 or routing.shape[1] != len(sparse):
            raise ValueError(
                f"routing must be [batch, {len(sparse)} sparse layers, tokens, "
                f"{self.config.num_experts_per_tok}], got shape {routing.shape}."
            )
        column = {layer: j for j, layer in enumerate(sparse)}
        return [routing[:, column[i]] if i in column else None for i in range(len(self.layers))]


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen2-MoE / Qwen3-MoE. ``model(input_ids, ...)`` -> logits, or
    ``(logits, aux)`` with ``return_aux=True``: aux["aux_loss"] is the weighted sum of
    the router losses (mean over sparse layers) to add to the mean token loss, and
    aux["router_balance"], aux["router_z"] the unweighted losses."""

    decoder_class = MoeModel
    returns_aux_losses = True

    def __init__(self, config: MoeConfig, **kwargs: Any):
        if not isinstance(config, MoeConfig):
            raise ValueError(
                f"config must be a MoeConfig, got {type(config).__name__}; build one with "
                "MoeConfig(...) or MoeConfig.from_dict(d)."
            )
        super().__init__(config, **kwargs)

    def hidden_states(
        self,
        input_ids: Array,
        *,
        return_aux: bool = False,
        return_routing: bool = False,
        **kwargs: Any,
    ):
        """Final-norm hidden states [B, T, D] (and with ``return_aux`` the router losses).
        ``return_routing``: (h, routing [B, S, T, k], the experts each token went to in each
        sparse layer); ``routing=`` (that shape, -1 where unknown) replays a sampler's."""
        h, aux = super().hidden_states(input_ids, **kwargs)
        routing = aux.pop("routing", None)
        if return_routing:
            return h, routing
        return (h, aux) if return_aux else h

    def __call__(self, input_ids: Array, *, return_aux: bool = False, **kwargs: Any):
        h, aux = self.hidden_states(input_ids, return_aux=True, **kwargs)
        logits = constrain(self.output_projection()(h), ACT_BTV)
        return (logits, aux) if return_aux else logits
