"""The jaxtrain classes that build a model section's ``model_type`` (CLI runs, resumes)."""

from __future__ import annotations

from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.llama import LlamaForCausalLM


def classes_for(model_type: str | None) -> tuple[type[LlamaConfig], type[LlamaForCausalLM]]:
    """(config class, model class) for ``model_type`` (None: the Llama family)."""
    from jaxtrain.models.gemma import GEMMA_MODEL_TYPES, GemmaConfig, GemmaForCausalLM
    from jaxtrain.models.moe import MOE_MODEL_TYPES, MoeConfig, MoeForCausalLM

    if model_type in MOE_MODEL_TYPES:
        return MoeConfig, MoeForCausalLM
    if model_type in GEMMA_MODEL_TYPES:
        return GemmaConfig, GemmaForCausalLM
    return LlamaConfig, LlamaForCausalLM
