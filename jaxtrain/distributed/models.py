"""Model configs at a scaling index, and building the model they describe (every registered
family: jaxtrain.models.classes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxtrain.distributed.config import MODEL_TASKS, RayDistributedConfig
from jaxtrain.errors import ArgumentError


def _classes(model_type: str | None, task: str | None) -> tuple[type, type]:
    from jaxtrain.models.classes import classes_for, task_of

    return classes_for(model_type, task or task_of(model_type))


def make_config(config_class: type, values: dict[str, Any], where: str) -> Any:
    """`config_class` from `values`; ArgumentError naming `where` and the unknown fields."""
    known = {f.name for f in dataclasses.fields(config_class)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ArgumentError(
            f"{where}: {config_class.__name__} has no field(s) {unknown}; known: {sorted(known)}."
        )
    try:
        return config_class(**values)
    except (TypeError, ValueError) as err:
        raise ArgumentError(f"{where}: {err}") from err


def base_config(config: RayDistributedConfig) -> Any:
    """The config that scaling starts from: a model directory's config.json or a dict, of
    the family of its model_type (RayDistributedConfig.model_type overrides it)."""
    from jaxtrain.models.classes import task_of

    source = config.pretrained_model_name_or_path
    if isinstance(source, dict):
        values = dict(source)
    else:
        from jaxtrain.hf.load import read_config, resolve_model_dir

        _, found = read_config(resolve_model_dir(source))
        values = found.to_dict()
    if config.model_type is not None:
        values["model_type"] = config.model_type
    model_type = values.get("model_type")
    task = task_of(model_type)
    if config.model_task is not None and config.model_task != task:
        raise ArgumentError(
            f"model_task={config.model_task!r}, but model_type={model_type!r} is a {task} "
            f"model; set model_task to {task!r} (or leave it None), or pick a model of "
            f"{config.model_task!r} (tasks: {', '.join(MODEL_TASKS)})."
        )
    config_class, _ = _classes(model_type, task)
    return make_config(config_class, values, "pretrained_model_name_or_path")


def scaled_config(config: RayDistributedConfig, scaling_index: int) -> Any:
    """The base config with scaled sizes (x scaling_index) and the fixed variables set.

    Variables that are not fields of this family's config (moe_intermediate_size of the
    default recipe on a dense model, dtype, mesh settings) leave the architecture alone.
    head_dim follows hidden_size / num_attention_heads again unless it is fixed explicitly.
    """
    base = base_config(config)
    values = base.to_dict()
    variables = config.variables_at(scaling_index)
    architecture = {k: v for k, v in variables.items() if k in values}
    if (
        "head_dim" in values
        and "head_dim" not in architecture
        and {"hidden_size", "num_attention_heads"} & set(architecture)
    ):
        values["head_dim"] = None
    values.update(architecture)
    try:
        return make_config(type(base), values, f"scaling_index={scaling_index}")
    except ArgumentError as err:
        raise ArgumentError(
            f"scaling_index={scaling_index} gives an invalid model config ({err}); adjust "
            "config_scaling_variables / config_variables."
        ) from err


def build_model(
    config: Any,
    *,
    model_class: type | None = None,
    dtype: Any = None,
    param_dtype: Any = None,
    seed: int = 0,
) -> Any:
    """A new model of `config` (its family's class unless `model_class` is given), compute
    `dtype`, stored `param_dtype`, initialised from `seed`."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxtrain.models.classes import task_of

    if model_class is None:
        model_type = getattr(config, "model_type", None)
        _, model_class = _classes(model_type, task_of(model_type))
    return model_class(
        config,
        dtype=jnp.dtype(dtype or "float32"),
        param_dtype=jnp.dtype(param_dtype or "float32"),
        rngs=nnx.Rngs(seed),
    )


def build_llama(config: Any, *, dtype: Any = None, param_dtype: Any = None, seed: int = 0) -> Any:
    """`build_model` (kept for callers of the Llama-only name)."""
    return build_model(config, dtype=dtype, param_dtype=param_dtype, seed=seed)


def checkpoint_config(step_dir: Path) -> Any:
    """The model config a checkpoint was written for (from its metadata), or None."""
    from jaxtrain.training.checkpoint import read_metadata

    values = read_metadata(step_dir).get("model_config")
    if not values:
        return None
    config_class, _ = _classes(values.get("model_type"), None)
    known = {f.name for f in dataclasses.fields(config_class)}
    return make_config(config_class, {k: v for k, v in values.items() if k in known}, str(step_dir))
