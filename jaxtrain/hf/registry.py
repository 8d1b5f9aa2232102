"""Model families by Hugging Face ``model_type``: the registry the hf package loads and
exports through (``AutoModelForCausalLM`` is in auto.py).

A ``ModelFamily`` says how one architecture maps to and from a Hugging Face directory: its
config conversion both ways, its model class, and its weight maps (see jaxtrain.hf.weights).
The registry below names, for every supported ``model_type``, where its family object lives
as a "module:attribute" string, imported on first use: a family pulls in only its own
code. It lives in jaxtrain.hf (models know nothing of Hugging Face) and imports only
jaxtrain.errors, so every hf module may use it. Add a family with one line in
``_FAMILIES`` or, at run time, with ``register_family``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxtrain.errors import HFError

TASKS = ("causal-lm", "image-classification")


def _nothing_ignorable(name: str, config: Any) -> bool:
    return False


@dataclass(frozen=True)
class ModelFamily:
    """One architecture family and its Hugging Face mapping.

    - ``from_hf_config(hf_dict, source)`` -> the family's config; raises HFError naming the
      field of ``source`` it cannot map.
    - ``to_hf_config(config, dtype_name)`` -> the ``config.json`` dict transformers reads.
    - ``param_maps(config)`` -> a ParamMap per parameter of ``model_class(config, ...)``.
    - ``ignorable(hf_tensor_name, config)``: tensors a checkpoint may hold that carry no weights.
    - ``model_class(config, *, dtype, param_dtype, rngs)`` builds the network.
    - ``canonical_name(hf_tensor_name)``: for checkpoints written in several layouts (Gemma 3
      with images), a tensor's name as ``param_maps`` names it; None: names are read as they
      are.
    """

    name: str
    model_types: tuple[str, ...]
    model_class: type
    from_hf_config: Callable[[dict[str, Any], str], Any]
    to_hf_config: Callable[[Any, str], dict[str, Any]]
    param_maps: Callable[[Any], list[Any]]
    ignorable: Callable[[str, Any], bool] = _nothing_ignorable
    task: str = "causal-lm"
    canonical_name: Callable[[str], str] | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"ModelFamily {self.name}: task={self.task!r} is not one of {TASKS}.")


# model_type -> the family, or where to import it from ("module:attribute").
_FAMILIES: dict[str, str | ModelFamily] = {
    "llama": "jaxtrain.hf.families:LLAMA",
    "mistral": "jaxtrain.hf.families:LLAMA",
    "qwen2": "jaxtrain.hf.families:LLAMA",
    "qwen3": "jaxtrain.hf.families:LLAMA",
    "mixtral": "jaxtrain.hf.families:MOE",
    "qwen2_moe": "jaxtrain.hf.families:MOE",
    "qwen3_moe": "jaxtrain.hf.families:MOE",
    "gemma2": "jaxtrain.hf.families:GEMMA",
    "gemma3_text": "jaxtrain.hf.families:GEMMA",
    "gemma3": "jaxtrain.hf.gemma3_vlm:GEMMA3",
    "qwen2_5_vl": "jaxtrain.hf.qwen25_vl:QWEN25_VL",
    "gpt2": "jaxtrain.hf.gpt2:GPT2",
    "vit": "jaxtrain.hf.vit:VIT",
}


def register_family(family: ModelFamily, *, replace: bool = False) -> None:
    """Make ``family`` the one for each of its model_types."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family expects a ModelFamily, got {type(family).__name__}.")
    taken = [t for t in family.model_types if t in _FAMILIES and not replace]
    if taken:
        raise ValueError(
            f"model_type(s) {taken} are already registered; pass replace=True to override them."
        )
    for model_type in family.model_types:
        _FAMILIES[model_type] = family


def supported_model_types(task: str | None = None) -> list[str]:
    """Every registered model_type (of one task, if given), sorted."""
    if task is None:
        return sorted(_FAMILIES)
    return sorted(t for t in _FAMILIES if get_family(t).task == task)


def get_family(model_type: Any, *, source: str = "config.json") -> ModelFamily:
    """The family of ``model_type``; HFError listing the supported types when unknown."""
    entry = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if entry is None:
        raise HFError(
            f"{source}: model_type: {model_type!r} is not supported. jaxtrain loads model_type "
            f"{', '.join(sorted(_FAMILIES))}."
        )
    if isinstance(entry, str):
        module, attribute = entry.split(":")
        entry = getattr(importlib.import_module(module), attribute)
        _FAMILIES[model_type] = entry
    return entry


def family_of(config: Any) -> ModelFamily:
    """The family of a model's config (by its ``model_type``)."""
    return get_family(getattr(config, "model_type", None), source=type(config).__name__)


def read_model_type(model_dir: str | Path) -> Any:
    """``model_type`` of ``model_dir/config.json`` (None when absent)."""
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise HFError(f"{path}: cannot read it as a JSON object ({err}).") from err
