"""Models in Flax NNX (Llama family, mixture-of-experts, Gemma, GPT-2, ViT), plus generation."""

from jaxtrain.models.auto import AutoModelForCausalLM
from jaxtrain.models.config import LlamaConfig
from jaxtrain.models.gemma import GemmaConfig, GemmaForCausalLM
from jaxtrain.models.generation import generate
from jaxtrain.models.gpt2 import GPT2Config, GPT2LMHeadModel
from jaxtrain.models.llama import REMAT_POLICIES, LlamaForCausalLM, logical_axes
from jaxtrain.models.moe import MoeConfig, MoeForCausalLM

__all__ = [
    "REMAT_POLICIES",
    "AutoModelForCausalLM",
    "GPT2Config",
    "GPT2LMHeadModel",
    "GemmaConfig",
    "GemmaForCausalLM",
    "LlamaConfig",
    "LlamaForCausalLM",
    "MoeConfig",
    "MoeForCausalLM",
    "generate",
    "logical_axes",
]
