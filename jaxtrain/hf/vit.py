"""ViT image classifier <-> Hugging Face ViTForImageClassification (config and weights)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxtrain.hf.errors import HFError
from jaxtrain.hf.registry import ModelFamily
from jaxtrain.hf.weights import ParamMap
from jaxtrain.models.vit import ViTConfig, ViTForImageClassification

_COPIED = ("image_size", "patch_size", "num_channels", "hidden_size", "num_hidden_layers",
           "num_attention_heads", "intermediate_size", "hidden_act", "layer_norm_eps",
           "initializer_range")  # fmt: skip


def vit_from_hf(hf: dict[str, Any], source: str = "config.json") -> ViTConfig:
    if hf.get("qkv_bias", True) is not True:
        raise HFError(
            f"{source}: qkv_bias: false is not supported (jaxtrain's ViT has q/k/v bias)."
        )
    labels = hf.get("id2label") or {}
    values = {k: hf[k] for k in _COPIED if k in hf}
    values["num_labels"] = len(labels) if labels else int(hf.get("num_labels", 2))
    try:
        return ViTConfig(**values)
    except (TypeError, ValueError) as err:
        raise HFError(f"{source}: {err}") from err


def vit_to_hf(config: ViTConfig, dtype: str = "float32") -> dict[str, Any]:
    if config.pooling != "cls":
        raise HFError(
            f"cannot export pooling={config.pooling!r}: HF ViTForImageClassification classifies "
            "from the class token; export a pooling='cls' model."
        )
    out = {"architectures": ["ViTForImageClassification"], "model_type": "vit"}
    out.update({k: getattr(config, k) for k in _COPIED})
    out.update(
        qkv_bias=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        id2label={str(i): f"LABEL_{i}" for i in range(config.num_labels)},
        label2id={f"LABEL_{i}": i for i in range(config.num_labels)}, dtype=dtype,
    )  # fmt: skip
    return out


def _map(path, names, shapes, to_jax, to_hf) -> ParamMap:
    return ParamMap(path, tuple(names), tuple(shapes), to_jax, to_hf)


def vit_param_maps(c: ViTConfig) -> list[ParamMap]:
    d, f, n, h, p = (
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.head_dim,
        c.patch_size,
    )
    e = "vit.embeddings"
    conv = (d, c.num_channels, p, p)
    maps = [
        _map("cls_token", [f"{e}.cls_token"], [(1, 1, d)], lambda t: t[0].reshape(d),
             lambda a: [a.reshape(1, 1, d)]),
        _map("position_embeddings", [f"{e}.position_embeddings"], [(1, c.num_patches + 1, d)],
             lambda t: t[0][0], lambda a: [a[None]]),
        _map("patch_embed/kernel", [f"{e}.patch_embeddings.projection.weight"], [conv],
             lambda t: t[0].reshape(d, -1).T, lambda a: [a.T.reshape(conv)]),
        _map("patch_embed/bias", [f"{e}.patch_embeddings.projection.bias"], [(d,)],
             lambda t: t[0], lambda a: [a]),
    ]  # fmt: skip
    for i in range(c.num_hidden_layers):
        ours, hf = f"layers/{i}", f"vit.encoder.layer.{i}"
        att = f"{hf}.attention.attention"
        for norm in ("layernorm_before", "layernorm_after"):
            for w in ("weight", "bias"):
                maps.append(_map(f"{ours}/{norm}/{w}", [f"{hf}.{norm}.{w}"], [(d,)],
                                 lambda t: t[0], lambda a: [a]))  # fmt: skip
        qkv = [f"{att}.{x}.weight" for x in ("query", "key", "value")]
        maps.append(_map(f"{ours}/qkv/kernel", qkv, [(d, d)] * 3,
                         lambda t: np.stack([x.T.reshape(d, n, h) for x in t], axis=1),
                         lambda a: [a[:, j].reshape(d, d).T for j in range(3)]))  # fmt: skip
        qkv_b = [f"{att}.{x}.bias" for x in ("query", "key", "value")]
        maps.append(_map(f"{ours}/qkv/bias", qkv_b, [(d,)] * 3,
                         lambda t: np.stack([x.reshape(n, h) for x in t]),
                         lambda a: [a[j].reshape(d) for j in range(3)]))  # fmt: skip
        for ours_name, hf_name, shape, kernel in (
            ("out", "attention.output.dense", (d, d), (n, h, d)),
            ("fc1", "intermediate.dense", (f, d), (d, f)),
            ("fc2", "output.dense", (d, f), (f, d)),
        ):
            maps.append(_map(f"{ours}/{ours_name}/kernel", [f"{hf}.{hf_name}.weight"], [shape],
                             lambda t, k=kernel: t[0].T.reshape(k),
                             lambda a, s=shape: [a.reshape(s[1], s[0]).T]))  # fmt: skip
            maps.append(_map(f"{ours}/{ours_name}/bias", [f"{hf}.{hf_name}.bias"], [(shape[0],)],
                             lambda t: t[0], lambda a: [a]))  # fmt: skip
    for w in ("weight", "bias"):
        maps.append(_map(f"layernorm/{w}", [f"vit.layernorm.{w}"], [(d,)], lambda t: t[0],
                         lambda a: [a]))  # fmt: skip
    maps.append(_map("classifier/kernel", ["classifier.weight"], [(c.num_labels, d)],
                     lambda t: t[0].T, lambda a: [a.T]))  # fmt: skip
    maps.append(_map("classifier/bias", ["classifier.bias"], [(c.num_labels,)], lambda t: t[0],
                     lambda a: [a]))  # fmt: skip
    return maps


VIT = ModelFamily(
    name="vit",
    model_types=("vit",),
    model_class=ViTForImageClassification,
    from_hf_config=vit_from_hf,
    to_hf_config=vit_to_hf,
    param_maps=vit_param_maps,
    ignorable=lambda name, config: name.startswith("vit.pooler."),
    task="image-classification",
)
