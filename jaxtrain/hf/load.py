"""Load a local Hugging Face model directory into the jaxtrain model of its model_type.

Weights go straight from the memory-mapped safetensors files to their devices, one
parameter at a time: with a ``sharding_for`` callback each device receives only its own
slice (``jax.make_array_from_callback``), so no host ever builds a full copy per device.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxtrain.hf.errors import HFError
from jaxtrain.hf.params import ShardingFor, load_weights  # noqa: F401 (ShardingFor: its old home)
from jaxtrain.hf.registry import ModelFamily, get_family
from jaxtrain.hf.safetensors_io import SafetensorsFile

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def looks_local(path: str | Path) -> bool:
    """True when `path` reads as a local path rather than a Hub id "org/name": absolute,
    starting with . or ~, more than two parts, or under a directory that exists here."""
    text = str(path)
    parts = Path(text).expanduser().parts
    return (
        Path(text).expanduser().is_absolute()
        or text.startswith((".", "~"))
        or len(parts) > 2
        or (len(parts) == 2 and Path(parts[0]).is_dir())
    )


def resolve_model_dir(path: str | Path) -> Path:
    """The local directory for ``path``: a directory, or a hub id already in the HF cache."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise HFError(
                f"{local} has no config.json; pass the directory of a Hugging Face model "
                "(config.json plus *.safetensors)."
            )
        return local
    if local.exists():
        raise HFError(f"{local} is a file; pass the model directory that contains it.")
    text = str(path)
    if _HUB_ID.fullmatch(text) and not looks_local(text):
        cached = _cached_snapshot(text)
        if cached is not None:
            return cached
        raise HFError(
            f"{text!r} is not a local directory. It looks like a Hugging Face Hub id, but "
            "jaxtrain does not download models (this machine has no hub access). Download it "
            f"where you can (e.g. `hf download {text} --local-dir DIR`) and pass the local DIR."
        )
    raise HFError(f"{text}: no such directory. Pass a local Hugging Face model directory.")


def _cached_snapshot(repo_id: str) -> Path | None:
    """A complete snapshot of ``repo_id`` in the local HF cache, looked up offline."""
    try:
        from huggingface_hub import snapshot_download

        found = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached, or no huggingface_hub: both mean "no local copy"
        return None
    return found if (found / "config.json").is_file() else None


# The Auto class of each task, for errors (auto.py imports this module, so not from there).
_AUTO_CLASS = {
    "causal-lm": "AutoModelForCausalLM",
    "image-classification": "AutoModelForImageClassification",
}


def read_config(
    model_dir: str | Path, task: str | None = None, model_class: type | None = None
) -> tuple[ModelFamily, Any]:
    """(family, config) from ``model_dir/config.json``; ``task`` / ``model_class`` refuse
    other kinds of model."""
    path = Path(model_dir) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise HFError(f"{path}: cannot read it as JSON ({err}).") from err
    if not isinstance(hf, dict):
        raise HFError(f"{path}: expected a JSON object, got {type(hf).__name__}.")
    family = get_family(hf.get("model_type"), source=str(path))
    if task is not None and family.task != task:
        raise HFError(
            f"{path}: model_type {hf.get('model_type')!r} is a {family.task} model, not a "
            f"{task} model; load it with {_AUTO_CLASS[family.task]}.from_pretrained(path) "
            "or jaxtrain.hf.from_pretrained(path)."
        )
    if model_class is not None and family.model_class is not model_class:
        raise HFError(
            f"{path}: model_type {hf.get('model_type')!r} is a {family.model_class.__name__}, "
            f"not a {model_class.__name__}; load it with jaxtrain.hf.from_pretrained(path) "
            "or AutoModelForCausalLM.from_pretrained(path)."
        )
    return family, family.from_hf_config(hf, str(path))


def open_weights(model_dir: str | Path) -> dict[str, SafetensorsFile]:
    """Tensor name -> the safetensors file holding it (single file, indexed shards, or all
    ``*.safetensors`` in the directory)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise HFError(f"{index}: not a valid index (needs a 'weight_map'): {err}.") from err
        files: dict[str, SafetensorsFile] = {}
        out = {}
        for name, file_name in weight_map.items():
            if file_name not in files:
                if not (model_dir / file_name).is_file():
                    raise HFError(
                        f"{index} maps {name!r} to {file_name}, which is missing from "
                        f"{model_dir}. Copy every shard the index lists."
                    )
                files[file_name] = SafetensorsFile(model_dir / file_name)
            if name not in files[file_name].names:
                raise HFError(f"{index} maps {name!r} to {file_name}, which has no such tensor.")
            out[name] = files[file_name]
        return out
    paths = (
        [model_dir / SINGLE_FILE]
        if (model_dir / SINGLE_FILE).is_file()
        else sorted(model_dir.glob("*.safetensors"))
    )
    if not paths:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pth")
        )
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        raise HFError(
            f"{model_dir} has no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors{hint}. "
            "jaxtrain reads safetensors weights only."
        )
    out = {}
    for path in paths:
        shard = SafetensorsFile(path)
        out.update(dict.fromkeys(shard.names, shard))
    return out


class RenamedTensor:
    """A tensor of a safetensors file read under another name (a family's canonical one)."""

    def __init__(self, file: SafetensorsFile, name: str):
        self.file, self.name, self.path = file, name, file.path

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.shape(self.name)

    def get(self, name: str) -> Any:
        return self.file.get(self.name)

    def release(self, name: str) -> None:
        self.file.release(self.name)


def from_pretrained(
    path: str | Path,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    sharding_for: ShardingFor | None = None,
    task: str | None = None,
    model_class: type | None = None,
    quantization: Any = None,
) -> nnx.Module:
    """The model of config.json's model_type with the weights of the HF directory ``path``.

    ``dtype`` is the compute dtype, ``param_dtype`` the stored one (the checkpoint's
    dtype is converted). ``sharding_for`` places each parameter (see ShardingFor).
    ``task`` ("causal-lm", "image-classification") or ``model_class`` refuse other models.
    ``quantization`` ("nf4", "int8" or a ``jaxtrain.quantization.BaseQuantization``): the
    base of a QLoRA run, its projections quantized tensor by tensor as they are read (peak
    memory: the quantized model plus one float tensor); train it with LoRA.
    A ``.gguf`` file, or a directory holding one and no config.json, goes to the GGUF importer
    (``jaxtrain.hf.gguf``, needs the gguf extra).
    """
    gguf_file = gguf_path(path)
    if gguf_file is not None:
        from jaxtrain.hf.gguf import from_gguf

        return from_gguf(
            gguf_file,
            dtype=dtype,
            param_dtype=param_dtype,
            sharding_for=sharding_for,
            quantization=quantization,
        )
    model_dir = resolve_model_dir(path)
    family, config = read_config(model_dir, task, model_class)
    tensors: dict[str, Any] = open_weights(model_dir)
    if family.canonical_name is not None:  # a family whose checkpoints come in several layouts
        tensors = {family.canonical_name(n): RenamedTensor(f, n) for n, f in tensors.items()}
    model = load_weights(
        family,
        config,
        tensors,
        source=model_dir,
        dtype=dtype,
        param_dtype=param_dtype,
        sharding_for=sharding_for,
        quantization=quantization,
    )
    model.name_or_path = str(path)
    return model


def gguf_path(path: str | Path) -> Path | None:
    """The .gguf file ``path`` names: the file itself, or the one in a directory that has no
    config.json (an HF directory with a stray .gguf loads as HF)."""
    local = Path(path).expanduser()
    if local.is_file() and local.suffix == ".gguf":
        return local
    if local.is_dir() and not (local / "config.json").exists():
        found = sorted(local.glob("*.gguf"))
        if len(found) > 1:
            raise HFError(
                f"{local} holds {len(found)} .gguf files ({', '.join(p.name for p in found)}); "
                "pass the path of the one to load."
            )
        return found[0] if found else None
    return None


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in an HF model directory (or a .gguf file), or None when it has none;
    a vision-language model's whole processor where it has one (`load_processing_class`)."""
    gguf_file = gguf_path(path)
    if gguf_file is not None:
        from jaxtrain.hf.gguf import gguf_tokenizer

        return gguf_tokenizer(gguf_file)
    model_dir = resolve_model_dir(path)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return None
    from jaxtrain.hf.tokenizer_files import load_processing_class

    try:
        return load_processing_class(model_dir)
    except Exception as err:  # transformers raises many types for a broken tokenizer
        raise HFError(f"{model_dir}: the tokenizer files cannot be loaded: {err}") from err
