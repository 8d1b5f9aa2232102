"""The jaxtrain classes that build a model section's ``model_type`` (CLI runs, resumes, Ray
recipes): every registered family."""

from __future__ import annotations

from typing import Any

# The task each family's model class serves (as jaxtrain.hf.registry.TASKS names them).
CAUSAL_LM, IMAGE_CLASSIFICATION = "causal-lm", "image-classification"


def classes_for(model_type: str | None, task: str = CAUSAL_LM) -> tuple[type[Any], type[Any]]:
    """(config class, model class) for ``model_type`` (None: the Llama family). The ViT is
    an image classifier: only ``task="image-classification"`` gives it (a causal-LM caller
    gets LlamaConfig, which names the model types it supports)."""
    from jaxtrain.models.config import LlamaConfig
    from jaxtrain.models.gemma import GEMMA_MODEL_TYPES, GemmaConfig, GemmaForCausalLM
    from jaxtrain.models.gpt2 import GPT2Config, GPT2LMHeadModel
    from jaxtrain.models.llama import LlamaForCausalLM
    from jaxtrain.models.moe import MOE_MODEL_TYPES, MoeConfig, MoeForCausalLM
    from jaxtrain.models.vit import ViTConfig, ViTForImageClassification

    if model_type in MOE_MODEL_TYPES:
        return MoeConfig, MoeForCausalLM
    if model_type == "gemma3":  # with its vision tower
        from jaxtrain.models.gemma3_vlm import Gemma3ForConditionalGeneration, Gemma3VisionConfig

        return Gemma3VisionConfig, Gemma3ForConditionalGeneration
    if model_type == "qwen2_5_vl":  # with its vision tower
        from jaxtrain.models.qwen25_vl import Qwen25VLConfig, Qwen25VLForConditionalGeneration

        return Qwen25VLConfig, Qwen25VLForConditionalGeneration
    if model_type in GEMMA_MODEL_TYPES:
        return GemmaConfig, GemmaForCausalLM
    if model_type == "gpt2":
        return GPT2Config, GPT2LMHeadModel
    if task == IMAGE_CLASSIFICATION:
        return ViTConfig, ViTForImageClassification
    return LlamaConfig, LlamaForCausalLM


def task_of(model_type: str | None) -> str:
    """The task of ``model_type``'s model class: causal-lm or image-classification."""
    return IMAGE_CLASSIFICATION if model_type == "vit" else CAUSAL_LM


def all_config_classes() -> tuple[type[Any], ...]:
    """The config class of every family (their fields: what a recipe may set)."""
    types = (None, "mixtral", "gemma2", "gpt2", "vit")
    return tuple(dict.fromkeys(classes_for(t, task_of(t))[0] for t in types))
