"""Hugging Face interop: load local HF checkpoints, export HF directories.

`AutoModelForCausalLM.from_pretrained(dir)` / `from_pretrained(dir)` build a jaxtrain model
from a local Hugging Face directory; `save_pretrained(model, dir)` writes one. The models
know nothing of this package (no `model.from_pretrained` method): hf builds on models.

No torch anywhere in this package: weights are read and written as safetensors with numpy.
"""

from jaxtrain.hf.auto import AutoModelForCausalLM, AutoModelForImageClassification
from jaxtrain.hf.config import from_hf_config, to_hf_config
from jaxtrain.hf.errors import HFError
from jaxtrain.hf.load import ShardingFor, from_pretrained, load_tokenizer, resolve_model_dir
from jaxtrain.hf.save import save_pretrained

__all__ = [
    "AutoModelForCausalLM",
    "AutoModelForImageClassification",
    "HFError",
    "ShardingFor",
    "from_hf_config",
    "from_pretrained",
    "load_tokenizer",
    "resolve_model_dir",
    "save_pretrained",
    "to_hf_config",
]
