"""Llama-family models in Flax NNX, plus simple generation."""

from jaxtrain.models.auto import AutoModelForCausalLM
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.generation import generate
from jaxtrain.models.llama import REMAT_POLICIES, LlamaForCausalLM, logical_axes

__all__ = [
    "REMAT_POLICIES",
    "AutoModelForCausalLM",
    "LlamaConfig",
    "LlamaForCausalLM",
    "generate",
    "logical_axes",
]
