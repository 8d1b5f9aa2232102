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
