"""LoRA adapters as a PEFT directory: adapter_config.json + adapter_model.safetensors.

PEFT keeps one adapter per Hugging Face linear layer: lora_A [r, in] and lora_B [out, r].
A whole-kernel adapter on jaxtrain's fused projections (q/k/v in one kernel, gate/up in
another) shares one A across the fused outputs, which PEFT represents exactly by repeating A
for each of them and splitting B along the output dims the way the weight map splits the
kernel. Part adapters (lora_targets q_proj, v_proj...: models.lora.FusedLoRA) are PEFT's own
layout: each part's A and B are written as they are. GPT-2's layers are Conv1D in
transformers (c_attn is fused there too), hence ``fan_in_fan_out`` for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxtrain.hf.errors import HFError
from jaxtrain.hf.tokenizer_files import save_tokenizer
from jaxtrain.models.lora import FusedLoRA, lora_projections

__all__ = ["save_peft_adapter"]

PREFIX = "base_model.model"


def _split(
    name: str, a: np.ndarray, b: np.ndarray, g: int
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(HF module name, lora_A [r, in], lora_B [out, r]) of one jaxtrain projection."""
    r = a.shape[-1]
    a_rows = a.reshape(-1, r).T  # in dims flattened in the kernel's order
    if name == "qkv_proj":  # b [r, k, g + 2, h]
        return [
            ("q_proj", a_rows, b[:, :, :g].reshape(r, -1).T),
            ("k_proj", a_rows, b[:, :, g].reshape(r, -1).T),
            ("v_proj", a_rows, b[:, :, g + 1].reshape(r, -1).T),
        ]
    if name == "gate_up_proj":  # b [r, 2, f]
        return [("gate_proj", a_rows, b[:, 0].T), ("up_proj", a_rows, b[:, 1].T)]
    return [(name, a_rows, b.reshape(r, -1).T)]  # o_proj, down_proj


def _adapters(name: str, lora: Any, g: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(HF module name, lora_A [r, in], lora_B [out, r]) of one adapted projection."""

    def arrays(adapter: Any) -> tuple[np.ndarray, np.ndarray]:
        a = np.asarray(jax.device_get(adapter.a[...]), np.float32)
        b = np.asarray(jax.device_get(adapter.b[...]), np.float32)
        return a, b

    if isinstance(lora, FusedLoRA):  # one A and one B per part already
        out = []
        for part, adapter in lora.parts.items():
            a, b = arrays(adapter)
            r = a.shape[-1]
            out.append((str(part), a.reshape(-1, r).T, b.reshape(r, -1).T))
        return out
    return _split(name, *arrays(lora), g)


def _target_modules(model: Any, modules: set[str]) -> list[str] | str:
    """PEFT's target_modules: the adapted modules' names, or, for a model whose adapters live
    in one part (`peft_modules`: a vision-language model's decoder), a pattern that keeps
    PEFT from adding adapters elsewhere (its tower has q_proj, fc1... too)."""
    scope = getattr(model, "peft_modules", None)
    if scope is None:
        return sorted(modules)
    return f"{scope}\\.({'|'.join(sorted(modules))})"


def _base_name(base: str | None) -> str | None:
    """A local base directory as its absolute path: a relative one would name another
    directory, or none, wherever the adapter is loaded from. A Hub id stays as it is."""
    if base and Path(base).is_dir() and not Path(base).is_absolute():
        return str(Path(base).resolve())
    return base


def save_peft_adapter(
    model: Any,
    save_directory: str | Path,
    *,
    tokenizer: Any = None,
    base_model: str | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write the adapters of `model` (a Llama-family causal LM or a GPT-2 with LoRA) in
    PEFT's format."""
    from safetensors.numpy import save_file

    config = getattr(model, "config", None)
    projections = lora_projections(model)
    model_type = getattr(config, "model_type", None)
    if config is None or not projections or model_type == "vit":
        raise HFError(
            "save_peft_adapter needs a causal LM (Llama family or GPT-2) with LoRA adapters; "
            "export other models merged (lora_format='merged')."
        )
    tensors: dict[str, np.ndarray] = {}
    modules: set[str] = set()
    first = projections[0][1].lora
    g = getattr(config, "num_queries_per_kv", 1)
    for path, projection in projections:
        parent = ".".join(str(p) for p in path[:-1])
        for hf_name, lora_a, lora_b in _adapters(str(path[-1]), projection.lora, g):
            modules.add(hf_name)
            stem = f"{PREFIX}.{parent}.{hf_name}"
            tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(lora_a)
            tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(lora_b)
    out = Path(save_directory)
    if jax.process_index() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": _base_name(base_model or getattr(model, "name_or_path", None)),
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": first.dropout,
        "target_modules": _target_modules(model, modules),
        "bias": "none",
        "fan_in_fan_out": model_type == "gpt2",
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    save_tokenizer(tokenizer, out, chat_template)
    return out
