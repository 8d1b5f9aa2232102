"""Auto classes: build the jaxtrain model a Hugging Face directory describes, for one task.

`AutoModelForCausalLM` and `AutoModelForImageClassification` dispatch on config.json's
`model_type` to the registered family (jaxtrain.hf.registry) and refuse a model of the other
task with an error naming the class to use. They live in `jaxtrain.hf`, not
`jaxtrain.models`: the hf package depends on the models, never the other way round
(tests/test_imports.py checks it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import jax.numpy as jnp

from jaxtrain.hf.load import from_pretrained


class _AutoModel:
    task: ClassVar[str]

    def __init__(self) -> None:
        raise TypeError(f"use {type(self).__name__}.from_pretrained(path).")

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        sharding_for: Any = None,
        quantization: Any = None,
    ):
        """Load a local HF model directory of this task; see ``jaxtrain.hf.from_pretrained``
        (``quantization="nf4"``: a QLoRA base, quantized as it is read)."""
        return from_pretrained(
            path,
            dtype=dtype,
            param_dtype=param_dtype,
            sharding_for=sharding_for,
            task=cls.task,
            quantization=quantization,
        )


class AutoModelForCausalLM(_AutoModel):
    """``AutoModelForCausalLM.from_pretrained(path)``: the model for config.json's model_type.

    ``path`` is a local Hugging Face directory (config.json + safetensors) of any causal-LM
    model_type in ``supported_model_types("causal-lm")``.
    """

    task = "causal-lm"


class AutoModelForImageClassification(_AutoModel):
    """``AutoModelForImageClassification.from_pretrained(path)``: an image classifier (ViT)
    from a local Hugging Face directory of a model_type in
    ``supported_model_types("image-classification")``."""

    task = "image-classification"
