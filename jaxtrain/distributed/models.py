"""Model configs at a scaling index, and building the model they describe."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxtrain.arguments import ArgumentError
from jaxtrain.distributed.config import RayDistributedConfig


def base_config(config: RayDistributedConfig) -> Any:
    """The LlamaConfig that scaling starts from: a model directory's config.json or a dict."""
    from jaxtrain.models import LlamaConfig

    source = config.pretrained_model_name_or_path
    if isinstance(source, dict):
        values = dict(source)
    else:
        from jaxtrain.hf.load import read_config, resolve_model_dir

        _, found = read_config(resolve_model_dir(source))
        if not isinstance(found, LlamaConfig):
            raise ArgumentError(
                f"{source}: RayDistributedTrainer builds Llama-family models (llama, mistral, "
                f"qwen2, qwen3); this config.json describes a {type(found).__name__}."
            )
        values = found.to_dict()
    if config.model_type is not None:
        values["model_type"] = config.model_type
    try:
        return LlamaConfig.from_dict(values)
    except ValueError as err:
        raise ArgumentError(f"pretrained_model_name_or_path: {err}") from err


def scaled_config(config: RayDistributedConfig, scaling_index: int) -> Any:
    """The base config with scaled sizes (x scaling_index) and the fixed variables set.

    head_dim follows hidden_size / num_attention_heads again unless it is fixed explicitly.
    """
    from jaxtrain.models import LlamaConfig

    values = base_config(config).to_dict()
    variables = config.variables_at(scaling_index)
    architecture = {k: v for k, v in variables.items() if k in values}
    if "head_dim" not in architecture and {"hidden_size", "num_attention_heads"} & set(
        architecture
    ):
        values["head_dim"] = None
    values.update(architecture)
    try:
        return LlamaConfig.from_dict(values)
    except ValueError as err:
        raise ArgumentError(
            f"scaling_index={scaling_index} gives an invalid model config ({err}); adjust "
            "config_scaling_variables / config_variables."
        ) from err


def build_llama(config: Any, *, dtype: Any = None, param_dtype: Any = None, seed: int = 0) -> Any:
    """A new LlamaForCausalLM (compute `dtype`, stored `param_dtype`, initialised from `seed`)."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxtrain.models import LlamaForCausalLM

    return LlamaForCausalLM(
        config,
        dtype=jnp.dtype(dtype or "float32"),
        param_dtype=jnp.dtype(param_dtype or "float32"),
        rngs=nnx.Rngs(seed),
    )


def checkpoint_config(step_dir: Path) -> Any:
    """The LlamaConfig a checkpoint was written for (from its metadata), or None."""
    from jaxtrain.models import LlamaConfig
    from jaxtrain.training.checkpoint import read_metadata

    values = read_metadata(step_dir).get("model_config")
    if not values:
        return None
    known = {f.name for f in dataclasses.fields(LlamaConfig)}
    return LlamaConfig.from_dict({k: v for k, v in values.items() if k in known})
