"""Write a jaxtrain model (any registered family) as a Hugging Face model directory.

Layout (what ``transformers.AutoModelForCausalLM.from_pretrained(dir)`` reads):
config.json, generation_config.json, model.safetensors or model-0000i-of-0000n.safetensors
plus model.safetensors.index.json, the tokenizer files, and a README.md model card.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.errors import ArgumentError
from jaxtrain.hf.errors import HFError
from jaxtrain.hf.load import INDEX_FILE, SINGLE_FILE
from jaxtrain.hf.model_card import render_model_card
from jaxtrain.hf.peft import save_peft_adapter
from jaxtrain.hf.registry import ModelFamily, family_of
from jaxtrain.hf.safetensors_io import write_safetensors
from jaxtrain.hf.tokenizer_files import save_tokenizer
from jaxtrain.models.lora import has_lora, merge_lora
from jaxtrain.pytrees import path_str
from jaxtrain.quantization import dequantize_base

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB", "500MB", "2GiB"."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if match and match.group(2).upper() in _UNITS and float(match.group(1)) > 0:
        return int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    raise HFError(f"max_shard_size={size!r} is not a size; use bytes or e.g. '5GB', '500MB'.")


def save_pretrained(
    model: nnx.Module,
    save_directory: str | Path,
    *,
    tokenizer: Any = None,
    max_shard_size: int | str = "5GB",
    dtype: Any = None,
    training_summary: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write ``model`` (of a registered family) as an HF directory; returns the directory.

    ``dtype``: the weights' dtype on disk (default: the parameters' own dtype).
    ``chat_template``: saved as the tokenizer's template (default: the tokenizer's own).
    ``training_summary``: facts for the README.md model card (see model_card.py).
    Every process must call this (sharded parameters are gathered); process 0 writes.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise HFError(
            f"save_pretrained needs a jaxtrain model with a config, got {type(model).__name__}."
        )
    family = family_of(config)
    limit = parse_size(max_shard_size)
    flat = {
        path_str(path): var.get_value()
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
    if dtype is None:
        dtype = next(iter(flat.values())).dtype
    dtype_name = jnp.dtype(dtype).name
    hf_config = family.to_hf_config(config, dtype_name)
    out = Path(save_directory)
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
            stale.unlink(missing_ok=True)  # never mix shards of an earlier export

    shards: list[list[str]] = []
    total = 0
    current: dict[str, np.ndarray] = {}
    current_bytes = 0
    for name, tensor in _hf_tensors(family, config, flat, np.dtype(jnp.dtype(dtype))):
        if current and current_bytes + tensor.nbytes > limit:
            shards.append(_write_shard(out, len(shards), current, writer))
            current, current_bytes = {}, 0
        current[name] = tensor
        current_bytes += tensor.nbytes
        total += tensor.nbytes
    if current:
        shards.append(_write_shard(out, len(shards), current, writer))
    if not writer:
        return out

    if len(shards) == 1:
        (out / _temp_name(0)).rename(out / SINGLE_FILE)
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            (out / _temp_name(i)).rename(out / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    if family.task == "causal-lm":  # a classifier generates nothing
        generation = {
            k: getattr(config, k)
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if getattr(config, k, None) is not None
        }
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_tokenizer(tokenizer, out, chat_template)
    summary = dict(training_summary or {})
    summary.setdefault("base_model", getattr(model, "name_or_path", None))
    (out / "README.md").write_text(render_model_card(config, hf_config, summary, family.task))
    return out


def save_program_state(
    program: Any,
    state: Any,
    save_directory: str | Path,
    *,
    lora_format: str = "merged",
    **kwargs: Any,
) -> Path:
    """A Program's trained model with `state`'s parameters as a Hugging Face directory
    (with LoRA: merged into the base weights, or a PEFT adapter directory when
    `lora_format="peft"`). kwargs go to `save_pretrained` (tokenizer, chat_template,
    training_summary, ...)."""
    model = program.model_from_state(state)
    if lora_format == "peft" and not has_lora(model):
        raise ArgumentError(
            "lora_format='peft' writes a LoRA adapter directory, and this model has no LoRA "
            "adapters (lora_rank=0); export it whole (lora_format='merged')."
        )
    if lora_format == "peft":
        return save_peft_adapter(
            model,
            save_directory,
            tokenizer=kwargs.get("tokenizer"),
            chat_template=kwargs.get("chat_template"),
        )
    if lora_format not in ("merged", "peft"):
        raise ArgumentError(f"lora_format={lora_format!r}: use 'merged' or 'peft'.")
    if has_lora(model):
        # A quantized base (QLoRA) is written in float: dequantized, then the adapters merged.
        model = merge_lora(dequantize_base(model))
    return save_pretrained(model, save_directory, **kwargs)


def _hf_tensors(
    family: ModelFamily, config: Any, flat: dict[str, Any], dtype: np.dtype
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, host array) in checkpoint order, one parameter gathered at a time."""
    for spec in family.param_maps(config):
        if spec.path not in flat:
            raise HFError(
                f"the model has no parameter {spec.path} that its config implies; was the "
                "model built from a different config?"
            )
        host = np.asarray(_gather(flat[spec.path])).astype(dtype)
        for name, tensor in zip(spec.hf_names, spec.to_hf(host)):
            yield name, np.ascontiguousarray(tensor)


def _gather(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(x, tiled=True)
    return jax.device_get(x)


def _temp_name(i: int) -> str:
    return f"model.tmp-{i:05d}.safetensors"


def _write_shard(out: Path, i: int, tensors: dict[str, np.ndarray], writer: bool) -> list[str]:
    if writer:
        write_safetensors(out / _temp_name(i), tensors, {"format": "pt"})
    return list(tensors)
