"""The Llama family (llama, mistral, qwen2, qwen3) as a ModelFamily for the registry."""

from __future__ import annotations

from jaxtrain.hf.config import ARCHITECTURES, from_hf_config, to_hf_config
from jaxtrain.hf.weights import ignorable, param_maps
from jaxtrain.models.auto import ModelFamily
from jaxtrain.models.llama import LlamaForCausalLM

LLAMA = ModelFamily(
    name="llama",
    model_types=tuple(ARCHITECTURES),
    model_class=LlamaForCausalLM,
    from_hf_config=lambda hf, source: from_hf_config(hf, source=source),
    to_hf_config=lambda config, dtype: to_hf_config(config, dtype=dtype),
    param_maps=param_maps,
    ignorable=ignorable,
)


def _moe_family() -> ModelFamily:
    from jaxtrain.hf import moe
    from jaxtrain.models.moe import MoeForCausalLM

    return ModelFamily(
        name="moe",
        model_types=tuple(moe.ARCHITECTURES),
        model_class=MoeForCausalLM,
        from_hf_config=moe.from_hf_moe_config,
        to_hf_config=moe.to_hf_moe_config,
        param_maps=moe.moe_param_maps,
        ignorable=moe.moe_ignorable,
    )


def _gemma_family() -> ModelFamily:
    from jaxtrain.hf import gemma
    from jaxtrain.models.gemma import GemmaForCausalLM

    return ModelFamily(
        name="gemma",
        model_types=tuple(gemma.ARCHITECTURES),
        model_class=GemmaForCausalLM,
        from_hf_config=gemma.from_hf_gemma_config,
        to_hf_config=gemma.to_hf_gemma_config,
        param_maps=gemma.gemma_param_maps,
        ignorable=gemma.gemma_ignorable,
    )


# Mixtral / Qwen2-MoE / Qwen3-MoE (models/moe.py) and Gemma 2 / Gemma 3 text (models/gemma.py).
MOE = _moe_family()
GEMMA = _gemma_family()
