"""Llama-family models in Flax NNX, plus simple generation."""

from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.generation import generate
from jaxtrain.models.llama import REMAT_POLICIES, LlamaForCausalLM, logical_axes

__all__ = [
    "REMAT_POLICIES",
    "LlamaConfig",
    "LlamaForCausalLM",
    "generate",
    "logical_axes",
]
