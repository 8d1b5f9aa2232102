"""Models in Flax NNX (Llama family, GPT-2, ViT), plus simple generation."""

from jaxtrain.models.auto import AutoModelForCausalLM
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.generation import generate
from jaxtrain.models.gpt2 import GPT2Config, GPT2LMHeadModel
from jaxtrain.models.llama import REMAT_POLICIES, LlamaForCausalLM, logical_axes

__all__ = [
    "REMAT_POLICIES",
    "AutoModelForCausalLM",
    "GPT2Config",
    "GPT2LMHeadModel",
    "LlamaConfig",
    "LlamaForCausalLM",
    "generate",
    "logical_axes",
]
