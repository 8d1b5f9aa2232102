"""HF tensor names <-> jaxtrain parameter paths, with the reshapes between them.

jaxtrain fuses q/k/v into one (embed, kv_heads, q_per_kv + 2, head_dim) kernel and gate/up
into one (embed, 2, mlp) kernel, and stores kernels input-major (x @ W); HF stores separate
nn.Linear weights output-major (W @ x). Each ParamMap converts one jaxtrain parameter from
and to its HF tensors, on host numpy arrays; nothing here touches devices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from jaxtrain.models.config import LlamaConfig


@dataclass(frozen=True)
class ParamMap:
    """One jaxtrain parameter and the HF tensors it is made of."""

    path: str  # jaxtrain parameter path, e.g. "model/layers/0/self_attn/qkv_proj/kernel"
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_jax: Callable[[list[np.ndarray]], np.ndarray]  # HF tensors (hf_names order) -> array
    to_hf: Callable[[np.ndarray], list[np.ndarray]]  # array -> HF tensors


def same_map(path: str, name: str, shape: tuple[int, ...]) -> ParamMap:
    return ParamMap(path, (name,), (shape,), lambda t: t[0], lambda a: [a])


def linear_map(path: str, name: str, out_in: tuple[int, int], ours: tuple[int, ...]) -> ParamMap:
    """An nn.Linear weight (out, in) <-> an input-major kernel of shape ``ours``."""
    out_dim, in_dim = out_in
    return ParamMap(
        path,
        (name,),
        (out_in,),
        lambda t: t[0].T.reshape(ours),
        lambda a: [a.reshape(in_dim, out_dim).T],
    )


def param_maps(config: LlamaConfig) -> list[ParamMap]:
    """Every parameter of LlamaForCausalLM(config), in HF checkpoint order."""
    c = config
    d, f, v = c.hidden_size, c.intermediate_size, c.vocab_size
    n, k, h = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g = c.num_queries_per_kv
    maps = [same_map("model/embed_tokens/embedding", "model.embed_tokens.weight", (v, d))]
    for i in range(c.num_hidden_layers):
        ours, hf = f"model/layers/{i}", f"model.layers.{i}"
        attn, mlp = f"{hf}.self_attn", f"{hf}.mlp"
        maps.append(
            same_map(f"{ours}/input_layernorm/weight", f"{hf}.input_layernorm.weight", (d,))
        )
        maps.append(
            ParamMap(
                f"{ours}/self_attn/qkv_proj/kernel",
                (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"),
                ((n * h, d), (k * h, d), (k * h, d)),
                lambda t, d=d, k=k, g=g, h=h: np.concatenate(
                    [
                        t[0].T.reshape(d, k, g, h),
                        t[1].T.reshape(d, k, 1, h),
                        t[2].T.reshape(d, k, 1, h),
                    ],
                    axis=2,
                ),
                lambda a, d=d, g=g: [
                    a[:, :, :g].reshape(d, -1).T,
                    a[:, :, g].reshape(d, -1).T,
                    a[:, :, g + 1].reshape(d, -1).T,
                ],
            )
        )
        if c.attention_bias:
            maps.append(
                ParamMap(
                    f"{ours}/self_attn/qkv_proj/bias",
                    (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"),
                    ((n * h,), (k * h,), (k * h,)),
                    lambda t, k=k, g=g, h=h: np.concatenate(
                        [t[0].reshape(k, g, h), t[1].reshape(k, 1, h), t[2].reshape(k, 1, h)],
                        axis=1,
                    ),
                    lambda a, g=g: [
                        a[:, :g].reshape(-1),
                        a[:, g].reshape(-1),
                        a[:, g + 1].reshape(-1),
                    ],
                )
            )
        if c.qk_norm:
            maps.append(same_map(f"{ours}/self_attn/q_norm/weight", f"{attn}.q_norm.weight", (h,)))
            maps.append(same_map(f"{ours}/self_attn/k_norm/weight", f"{attn}.k_norm.weight", (h,)))
        maps.append(
            linear_map(
                f"{ours}/self_attn/o_proj/kernel", f"{attn}.o_proj.weight", (d, n * h), (n, h, d)
            )
        )
        maps.append(
            same_map(
                f"{ours}/post_attention_layernorm/weight",
                f"{hf}.post_attention_layernorm.weight",
                (d,),
            )
        )
        maps.append(
            ParamMap(
                f"{ours}/mlp/gate_up_proj/kernel",
                (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"),
                ((f, d), (f, d)),
                lambda t: np.stack([t[0].T, t[1].T], axis=1),
                lambda a: [a[:, 0].T, a[:, 1].T],
            )
        )
        if c.mlp_bias:
            maps.append(
                ParamMap(
                    f"{ours}/mlp/gate_up_proj/bias",
                    (f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"),
                    ((f,), (f,)),
                    lambda t: np.stack([t[0], t[1]]),
                    lambda a: [a[0], a[1]],
                )
            )
        maps.append(
            linear_map(f"{ours}/mlp/down_proj/kernel", f"{mlp}.down_proj.weight", (d, f), (f, d))
        )
        if c.mlp_bias:
            maps.append(same_map(f"{ours}/mlp/down_proj/bias", f"{mlp}.down_proj.bias", (d,)))
    maps.append(same_map("model/norm/weight", "model.norm.weight", (d,)))
    if not c.tie_word_embeddings:
        maps.append(linear_map("lm_head/kernel", "lm_head.weight", (v, d), (d, v)))
    return maps


# Tensors an HF checkpoint may hold that carry no weights of the network.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def ignorable(name: str, config: LlamaConfig) -> bool:
    """HF tensors that jaxtrain does not need: rotary buffers, a tied lm_head copy."""
    if name.endswith(IGNORED_SUFFIXES):
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"
