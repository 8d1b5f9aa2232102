"""Hugging Face mapping of the mixture-of-experts families: mixtral, qwen2_moe, qwen3_moe.

Attention, norms and embeddings are the Llama family's (each MoE type is a Llama-family
type plus experts: mixtral ~ mistral, qwen2_moe ~ qwen2, qwen3_moe ~ qwen3), so the config
and weight maps reuse jaxtrain.hf.config / weights and replace only the MLP of sparse
layers. Checkpoints hold one tensor per expert and projection (the layout transformers
writes and the Hub serves); jaxtrain stacks them into (expert, ...) kernels.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from jaxtrain.hf.config import from_hf_config as llama_from_hf
from jaxtrain.hf.config import to_hf_config as llama_to_hf
from jaxtrain.hf.errors import HFError
from jaxtrain.hf.weights import ParamMap, linear_map
from jaxtrain.hf.weights import ignorable as llama_ignorable
from jaxtrain.hf.weights import param_maps as llama_param_maps
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.moe import MoeConfig

logger = logging.getLogger("jaxtrain.hf")

ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# The Llama-family type with the same attention.
_DENSE_TWIN = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
# HF names of the expert projections (gate, up, down) and of the MoE block.
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def from_hf_moe_config(hf: dict[str, Any], source: str = "config.json") -> MoeConfig:
    """MoeConfig equivalent to an HF mixtral/qwen2_moe/qwen3_moe config dict."""
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise HFError(f"{source}: model_type: {model_type!r} is not a MoE type {ARCHITECTURES}.")

    def fail(field: str, problem: str, fix: str) -> HFError:
        return HFError(f"{source}: {field}: {problem}. {fix}")

    twin = dict(hf, model_type=_DENSE_TWIN[model_type])
    if model_type == "qwen2_moe":
        twin.pop("attention_bias", None)  # qwen2_moe spells it qkv_bias (below)
    dense = llama_from_hf(twin, source=source)
    values = dense.to_dict()
    values["model_type"] = model_type
    if model_type == "mixtral":
        if hf.get("router_jitter_noise"):
            raise fail(
                "router_jitter_noise",
                f"{hf['router_jitter_noise']} is not supported",
                "jaxtrain routes without noise; set it to 0.0.",
            )
        values["num_experts"] = hf.get("num_local_experts", 8)
        values["norm_topk_prob"] = True
        values["moe_intermediate_size"] = hf["intermediate_size"]
    else:
        # transformers 5 writes qwen3_moe's num_experts as num_local_experts.
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if not experts:
            raise fail(
                "num_experts",
                f"{experts!r} leaves no experts",
                f"Load it as model_type {_DENSE_TWIN[model_type]!r} instead.",
            )
        values["num_experts"] = experts
        values["norm_topk_prob"] = bool(hf.get("norm_topk_prob", False))
        values["moe_intermediate_size"] = hf.get("moe_intermediate_size")
        values["decoder_sparse_step"] = hf.get("decoder_sparse_step", 1) or 1
        values["mlp_only_layers"] = list(hf.get("mlp_only_layers") or [])
    if model_type == "qwen2_moe":
        values["attention_bias"] = bool(hf.get("qkv_bias", True))
        values["shared_expert_intermediate_size"] = int(
            hf.get("shared_expert_intermediate_size") or 0
        )
        if not values["shared_expert_intermediate_size"]:
            raise fail(
                "shared_expert_intermediate_size",
                "0 is not supported (HF's Qwen2-MoE always has a shared expert)",
                "Use qwen3_moe for a model without a shared expert.",
            )
    values["num_experts_per_tok"] = hf.get("num_experts_per_tok", 2)
    if hf.get("router_aux_loss_coef") is not None:
        values["router_aux_loss_coef"] = float(hf["router_aux_loss_coef"])
    try:
        return MoeConfig(**values)
    except ValueError as err:
        raise HFError(f"{source}: {err}") from err


def _dense_twin_config(config: MoeConfig) -> LlamaConfig:
    names = {f.name for f in dataclasses.fields(LlamaConfig)}
    values = {k: v for k, v in config.to_dict().items() if k in names}
    values["model_type"] = _DENSE_TWIN[config.model_type]
    if config.model_type == "qwen2_moe" and not config.attention_bias:
        # Qwen2 always biases q, k and v; Qwen2-MoE may not (qkv_bias): Llama's layers then.
        if config.sliding_window is not None:
            raise HFError(
                "cannot export model_type='qwen2_moe' with a sliding_window and no q/k/v bias "
                "(attention_bias=False): no transformers class has both."
            )
        values["model_type"] = "llama"
    if config.model_type == "qwen3_moe" and not config.qk_norm:
        raise HFError(
            "cannot export model_type='qwen3_moe' without qk_norm: Qwen3-MoE normalises each "
            "head's q and k, and this model does not. Build Qwen3-MoE models with "
            "qk_norm=True, as transformers' are."
        )
    return LlamaConfig(**values)


def to_hf_moe_config(config: MoeConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` dict transformers reads back as the same network."""
    mt = config.model_type
    if config.capacity_factor is not None:
        logger.warning(
            "jaxtrain: exporting a model trained with capacity_factor=%s: transformers' %s "
            "routes every token to its experts (no capacity), so the export's outputs differ "
            "from this model's wherever an expert overflowed its capacity.",
            config.capacity_factor, ARCHITECTURES[mt],
        )  # fmt: skip
    out = llama_to_hf(_dense_twin_config(config), dtype=dtype)
    out["model_type"] = mt
    out["architectures"] = [ARCHITECTURES[mt]]
    out["num_experts_per_tok"] = config.num_experts_per_tok
    out["router_aux_loss_coef"] = config.router_aux_loss_coef
    out["output_router_logits"] = False
    if mt == "mixtral":
        if not config.norm_topk_prob or config.moe_intermediate_size != config.intermediate_size:
            raise HFError(
                "cannot export model_type='mixtral': Mixtral always normalises the top-k "
                "weights and its experts have intermediate_size; set norm_topk_prob=True and "
                "moe_intermediate_size=intermediate_size, or export as qwen3_moe."
            )
        if config.shared_expert_intermediate_size or config.num_sparse_layers != (
            config.num_hidden_layers
        ):
            raise HFError(
                "cannot export model_type='mixtral' with a shared expert or dense layers; "
                "use qwen2_moe (shared expert) or qwen3_moe (mlp_only_layers)."
            )
        out["num_local_experts"] = config.num_experts
        out["router_jitter_noise"] = 0.0
        return out
    if mt == "qwen3_moe" and config.shared_expert_intermediate_size:
        raise HFError("cannot export model_type='qwen3_moe' with a shared expert; use qwen2_moe.")
    if mt == "qwen2_moe" and not config.shared_expert_intermediate_size:  # as from_hf reads
        raise HFError(
            "cannot export model_type='qwen2_moe' without a shared expert: transformers' "
            "Qwen2-MoE always has one. Use qwen3_moe for a model without."
        )
    out["num_experts"] = config.num_experts
    out["moe_intermediate_size"] = config.moe_intermediate_size
    out["norm_topk_prob"] = config.norm_topk_prob
    out["decoder_sparse_step"] = config.decoder_sparse_step
    out["mlp_only_layers"] = list(config.mlp_only_layers)
    if mt == "qwen2_moe":
        out["qkv_bias"] = config.attention_bias
        out.pop("attention_bias", None)
        out["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return out


def moe_param_maps(config: MoeConfig) -> list[ParamMap]:
    """Every parameter of MoeForCausalLM(config), in HF checkpoint order."""
    c = config
    d, e, f = c.hidden_size, c.num_experts, c.moe_intermediate_size
    block, (g_name, u_name, d_name) = _EXPERT_NAMES[c.model_type]
    maps = []
    for spec in llama_param_maps(_dense_twin_config(c)):
        parts = spec.path.split("/")
        sparse = parts[1] == "layers" and c.is_sparse_layer(int(parts[2]))
        if sparse and parts[3] == "mlp":
            if parts[4] != "down_proj":
                continue  # the whole MoE block is added once, in place of down_proj
            ours, hf = f"model/layers/{parts[2]}/mlp", f"model.layers.{parts[2]}.{block}"
            experts = [f"{hf}.experts.{j}" for j in range(e)]
            maps.append(linear_map(f"{ours}/gate/kernel", f"{hf}.gate.weight", (e, d), (d, e)))
            maps.append(
                ParamMap(
                    f"{ours}/gate_up",
                    tuple(f"{x}.{g_name}.weight" for x in experts)
                    + tuple(f"{x}.{u_name}.weight" for x in experts),
                    ((f, d),) * (2 * e),
                    lambda t, e=e: np.stack(
                        [np.stack([t[j].T, t[e + j].T], axis=1) for j in range(e)]
                    ),
                    lambda a: [w[:, 0].T for w in a] + [w[:, 1].T for w in a],
                )
            )
            maps.append(
                ParamMap(
                    f"{ours}/down",
                    tuple(f"{x}.{d_name}.weight" for x in experts),
                    ((d, f),) * e,
                    lambda t: np.stack([w.T for w in t]),
                    lambda a: [w.T for w in a],
                )
            )
            s = c.shared_expert_intermediate_size
            if s:
                sh = f"{hf}.shared_expert"
                maps.append(
                    ParamMap(
                        f"{ours}/shared_expert/gate_up_proj/kernel",
                        (f"{sh}.gate_proj.weight", f"{sh}.up_proj.weight"),
                        ((s, d), (s, d)),
                        lambda t: np.stack([t[0].T, t[1].T], axis=1),
                        lambda a: [a[:, 0].T, a[:, 1].T],
                    )
                )
                maps.append(
                    linear_map(
                        f"{ours}/shared_expert/down_proj/kernel",
                        f"{sh}.down_proj.weight",
                        (d, s),
                        (s, d),
                    )
                )
                maps.append(
                    linear_map(
                        f"{ours}/shared_expert_gate/kernel",
                        f"{hf}.shared_expert_gate.weight",
                        (1, d),
                        (d, 1),
                    )
                )
            continue
        maps.append(spec)
    return maps


def moe_ignorable(name: str, config: MoeConfig) -> bool:
    return llama_ignorable(name, config)
