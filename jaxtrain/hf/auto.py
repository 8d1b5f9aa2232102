"""AutoModelForCausalLM: build the jaxtrain model a Hugging Face directory describes.

It lives in `jaxtrain.hf`, not `jaxtrain.models`: the hf package depends on the models,
never the other way round (tests/test_imports.py checks it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp

from jaxtrain.hf.load import from_pretrained


class AutoModelForCausalLM:
    """``AutoModelForCausalLM.from_pretrained(path)``: the model for config.json's model_type.

    ``path`` is a local Hugging Face directory (config.json + safetensors) of any causal-LM
    model_type in ``supported_model_types("causal-lm")``.
    """

    def __init__(self) -> None:
        raise TypeError("use AutoModelForCausalLM.from_pretrained(path).")

    @staticmethod
    def from_pretrained(
        path: str | Path,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        sharding_for: Any = None,
    ):
        """Load a local HF model directory; see ``jaxtrain.hf.from_pretrained``."""
        return from_pretrained(
            path,
            dtype=dtype,
            param_dtype=param_dtype,
            sharding_for=sharding_for,
            task="causal-lm",
        )
