"""RayDistributedConfig: the model side of a Ray run, saved and loaded as readable JSON.

```json
{"pretrained_model_name_or_path": "runs/base/export",
 "config_scaling_variables": {"hidden_size": 256, "intermediate_size": 1024},
 "config_variables": {"dtype": "bfloat16", "sharding_axis_dims": [1, -1, 1, 1, 1]}}
```
`config_scaling_variables` are multiplied by the `scaling_index` of a run;
`config_variables` are fixed. A variable is one of three kinds, decided by its name:
- a field of a model config (hidden_size, num_hidden_layers, rope_theta, the MoE's
  moe_intermediate_size, GPT-2's or ViT's own...): the architecture; a field the run's family
  lacks is left out (the default recipe scales moe_intermediate_size, a dense model has none);
- `dtype`, `param_dtype`, `seed`: how a new model is built (compute/stored dtype, init seed);
- `sharding_axis_dims`, `sharding_rules`, `sharding_regex_rules`, `gradient_checkpointing`:
  TrainingArguments fields that every run of this trainer uses (the mesh axis settings).
Dtypes are kept as numpy dtypes and written as their names ("bfloat16"); mesh dims are tuples
written as JSON lists. Nothing else is accepted, so a typo fails early with the known names.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import Any

from jaxtrain.errors import ArgumentError

BUILD_KEYS = ("dtype", "param_dtype", "seed")
ARGUMENT_KEYS = (
    "sharding_axis_dims",
    "sharding_rules",
    "sharding_regex_rules",
    "gradient_checkpointing",
)
MODEL_TASKS = ("causal-lm", "image-classification")
_DTYPE_KEYS = ("dtype", "param_dtype")
_TUPLE_KEYS = ("sharding_axis_dims",)


def _llama_fields() -> dict[str, Any]:
    """The fields of every family's model config (jaxtrain.models.classes), with types."""
    from jaxtrain.models.classes import all_config_classes

    fields: dict[str, Any] = {}
    for config_class in all_config_classes():
        fields.update(typing.get_type_hints(config_class))
    return fields


def _normalize_value(key: str, value: Any, where: str) -> Any:
    """The canonical in-memory form of one variable (dtype objects, tuples)."""
    if key in _DTYPE_KEYS and value is not None:
        import jax.numpy as jnp

        try:
            return jnp.dtype(value)
        except TypeError:
            raise ArgumentError(
                f"{where}[{key!r}]={value!r} is not a dtype; use a name such as 'float32' or "
                "'bfloat16' (or jnp.bfloat16)."
            ) from None
    if key in _TUPLE_KEYS and value is not None:
        return tuple(int(v) for v in value)
    return value


def _check_variables(values: dict[str, Any] | None, where: str) -> dict[str, Any]:
    values = dict(values or {})
    known = set(_llama_fields()) | set(BUILD_KEYS) | set(ARGUMENT_KEYS)
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        raise ArgumentError(
            f"{where} has unknown key(s) {unknown}. Use model config fields, "
            f"{', '.join(BUILD_KEYS)} (model building) or {', '.join(ARGUMENT_KEYS)} "
            "(mesh settings)."
        )
    return {k: _normalize_value(k, v, where) for k, v in values.items()}


def _to_json_value(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.dtype):
        return value.name
    if isinstance(value, tuple):
        return [_to_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_json_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_json_value(v) for v in value]
    return value


@dataclasses.dataclass
class RayDistributedConfig:
    """What a RayDistributedTrainer needs to build, scale and load its model (JSON-able).

    `pretrained_model_name_or_path` is a local Hugging Face model directory (its config.json
    is the base architecture, its tokenizer the processor) or a dict of model config fields
    (`model_type` picks the family: llama, mistral, qwen2, qwen3, gemma2, gemma3_text, gpt2,
    mixtral, qwen2_moe, qwen3_moe, vit). `model_task` ("causal-lm" or "image-classification",
    None: the family's) is checked against the family when the config is built.
    """

    pretrained_model_name_or_path: str | dict[str, Any]
    # Where the run's checkpoints live (a run directory or its checkpoints/ folder).
    bucket_path: str | None = None
    # Tokenizer directory when it is not the model directory.
    processor_name_or_path: str | None = None
    model_type: str | None = None
    model_task: str | None = None
    config_scaling_variables: dict[str, int] | None = None
    config_variables: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        source = self.pretrained_model_name_or_path
        if isinstance(source, Path):
            self.pretrained_model_name_or_path = source = str(source)
        if not isinstance(source, (str, dict)):
            raise ArgumentError(
                "pretrained_model_name_or_path must be a model directory or a dict of "
                f"model config fields, got {type(source).__name__}."
            )
        if self.model_task is not None and self.model_task not in MODEL_TASKS:
            raise ArgumentError(
                f"model_task={self.model_task!r} is not a task; use one of {MODEL_TASKS} "
                "(or None: the task of the model_type's family)."
            )
        if self.bucket_path is not None:
            self.bucket_path = str(self.bucket_path)
        scaling = dict(self.config_scaling_variables or {})
        fields = _llama_fields()
        for key, value in scaling.items():
            if key not in fields:
                raise ArgumentError(
                    f"config_scaling_variables[{key!r}]: not a model config field; only "
                    "architecture sizes scale (hidden_size, intermediate_size, "
                    "num_attention_heads, num_key_value_heads, num_hidden_layers, ...)."
                )
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ArgumentError(
                    f"config_scaling_variables[{key!r}]={value!r} must be a positive int "
                    "(it is multiplied by scaling_index)."
                )
        self.config_scaling_variables = scaling
        self.config_variables = _check_variables(self.config_variables, "config_variables")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: dtypes as their names, tuples as lists."""
        return {f.name: _to_json_value(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> RayDistributedConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ArgumentError(
                f"{source}: unknown RayDistributedConfig key(s) {unknown}; known: "
                f"{', '.join(sorted(known))}."
            )
        if "pretrained_model_name_or_path" not in values:
            raise ArgumentError(f"{source}: 'pretrained_model_name_or_path' is required.")
        return cls(**values)  # __post_init__ turns names back into dtypes, lists into tuples

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> RayDistributedConfig:
        path = Path(path)
        try:
            values = json.loads(path.read_text())
        except FileNotFoundError:
            raise ArgumentError(f"{path}: no such RayDistributedConfig file.") from None
        except json.JSONDecodeError as err:
            raise ArgumentError(f"{path} is not valid JSON: {err}.") from None
        if not isinstance(values, dict):
            raise ArgumentError(f"{path} must hold a JSON object.")
        return cls.from_dict(values, source=str(path))

    # ------------------------------------------------------------- variables
    def variables_at(self, scaling_index: int) -> dict[str, Any]:
        """All variables of a run at `scaling_index`: scaled sizes, then the fixed ones."""
        if isinstance(scaling_index, bool) or not isinstance(scaling_index, int):
            raise ArgumentError(f"scaling_index must be a positive int, got {scaling_index!r}.")
        if scaling_index <= 0:
            raise ArgumentError(f"scaling_index must be a positive int, got {scaling_index}.")
        scaled = {k: v * scaling_index for k, v in self.config_scaling_variables.items()}
        return {**scaled, **self.config_variables}

    @property
    def argument_overrides(self) -> dict[str, Any]:
        """The TrainingArguments fields fixed by config_variables (mesh axis settings)."""
        return {k: v for k, v in self.config_variables.items() if k in ARGUMENT_KEYS}

    @property
    def build_options(self) -> dict[str, Any]:
        """dtype / param_dtype / seed for building a new model."""
        return {k: v for k, v in self.config_variables.items() if k in BUILD_KEYS}
