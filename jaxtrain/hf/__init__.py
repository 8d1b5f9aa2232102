"""Hugging Face interop: load local HF checkpoints, export HF directories.

No torch anywhere in this package: weights are read and written as safetensors with numpy.
"""

from jaxtrain.hf.config import from_hf_config, to_hf_config
from jaxtrain.hf.errors import HFError
from jaxtrain.hf.load import ShardingFor, from_pretrained, load_tokenizer, resolve_model_dir
from jaxtrain.hf.save import save_pretrained

__all__ = [
    "HFError",
    "ShardingFor",
    "from_hf_config",
    "from_pretrained",
    "load_tokenizer",
    "resolve_model_dir",
    "save_pretrained",
    "to_hf_config",
]
