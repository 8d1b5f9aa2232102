"""Load a llama.cpp GGUF file into jaxtrain, dequantised, with its tokenizer and chat template.

Needs the optional ``gguf`` package (``pip install 'jaxtrain[gguf]'``). The file's metadata
becomes a Hugging Face style config dict, each GGUF tensor is renamed to its HF name and
dequantised to float32 on the host when its parameter is placed (``gguf.dequantize``), and the
Llama family's loader does the rest, so shape checks and ``sharding_for`` work as for
safetensors. llama.cpp stores q/k projections with the rotary halves interleaved; they are
permuted back to HF's layout here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxtrain.hf.errors import HFError

SUPPORTED_ARCHITECTURES = ("llama",)
# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _import_gguf():
    try:
        import gguf
    except ImportError as err:
        raise HFError(
            "loading .gguf files needs the gguf package: pip install 'jaxtrain[gguf]'."
        ) from err
    return gguf


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (rotary pairs interleaved) to HF's (halves split)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFTensors:
    """The tensors of one GGUF file under their HF names, dequantised on ``get``."""

    def __init__(self, reader: Any, path: Path, config: dict[str, Any]):
        self.path = path
        self._gguf = _import_gguf()
        self._tensors: dict[str, Any] = {}
        unknown = []
        for tensor in reader.tensors:
            hf = _hf_name(tensor.name)
            if hf is None:
                unknown.append(tensor.name)
            else:
                self._tensors[hf] = tensor
        if unknown:
            raise HFError(
                f"{path}: tensor(s) {unknown[:3]} have no place in a {config['model_type']} "
                "model; jaxtrain loads plain Llama-architecture GGUF files."
            )
        self._heads = {
            "q_proj": config["num_attention_heads"],
            "k_proj": config["num_key_value_heads"],
        }

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __iter__(self):
        return iter(self._tensors)

    def __getitem__(self, name: str) -> GGUFTensors:
        return self  # the loader asks tensors[name].shape(name) / .get(name) / .path

    def values(self):
        return [self] * len(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        # GGUF lists dims fastest-first; numpy/HF order is the reverse.
        return tuple(int(d) for d in reversed(self._tensors[name].shape.tolist()))

    def get(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        values = self._gguf.dequantize(tensor.data, tensor.tensor_type)
        values = np.asarray(values, np.float32).reshape(self.shape(name))
        for proj, heads in self._heads.items():
            if name.endswith(f"self_attn.{proj}.weight"):
                values = _unpermute(values, heads)
        return values

    def release(self, name: str) -> None:
        """Nothing to drop: `get` returns a dequantised copy, and a GGUF file's quantized
        bytes are a fraction of the float model's."""


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader: Any, path: Path) -> dict[str, Any]:
    """An HF ``config.json`` style dict from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise HFError(
            f"{path}: general.architecture: {arch!r} is not supported; jaxtrain loads GGUF "
            f"architectures {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise HFError(f"{path}: {arch}.rope.scaling.type: {scaling!r} is not supported.")
    names = {t.name for t in reader.tensors}
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    hf = {
        "model_type": arch,
        "vocab_size": _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None),
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length"),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 2048),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    return {k: v for k, v in hf.items() if v is not None}


def from_gguf(
    path: str | Path,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    sharding_for: Any = None,
    quantization: Any = None,
):
    """The jaxtrain model of a .gguf file, every tensor dequantised to ``param_dtype``
    (``quantization``: the projections then quantized as they are read, see load_weights)."""
    from jaxtrain.hf.params import load_weights
    from jaxtrain.hf.registry import get_family

    gguf = _import_gguf()
    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # the reader raises ValueError/struct errors on a bad file
        raise HFError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err}).") from err
    hf = gguf_config(reader, path)
    family = get_family(hf["model_type"], source=str(path))
    config = family.from_hf_config(hf, str(path))
    tensors = GGUFTensors(reader, path, {**hf, "num_key_value_heads": config.num_key_value_heads})
    model = load_weights(
        family,
        config,
        tensors,
        source=path,
        dtype=dtype,
        param_dtype=param_dtype,
        sharding_for=sharding_for,
        quantization=quantization,
    )
    model.name_or_path = str(path)
    return model


def gguf_tokenizer(path: str | Path) -> Any:
    """The tokenizer (with its chat template) stored in a .gguf file, via transformers."""
    _import_gguf()
    from transformers import AutoTokenizer

    path = Path(path)
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as err:  # transformers raises many types for an unconvertible tokenizer
        raise HFError(f"{path}: the tokenizer in this GGUF file cannot be loaded: {err}") from err
