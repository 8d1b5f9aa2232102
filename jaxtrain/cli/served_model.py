"""What `jaxtrain serve` loads: a run directory, a Hugging Face directory (or .gguf file), or a
PEFT LoRA export, as (causal LM, tokenizer, the model's name).

A LoRA export is served merged: its base (the adapter's `base_model_name_or_path`, a local
directory) with B @ A * alpha / r added to each adapted weight, in Hugging Face's names, then
loaded like any Hugging Face directory. No weights are downloaded.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from jaxtrain.errors import ArgumentError

__all__ = ["load_served_model", "merged_peft_directory"]

PEFT_PREFIX = "base_model.model."


def load_served_model(path: str | Path) -> tuple[Any, Any, str]:
    """(model, tokenizer, name) of a run directory, an HF directory or .gguf, or a LoRA export."""
    source = Path(path)
    if not source.exists():
        raise ArgumentError(f"{path}: no such run directory, model directory or .gguf file.")
    if (source / "config.yaml").is_file():
        from jaxtrain.cli.run_dir import restore_run

        run = restore_run(source)
        if not run.sections.task.generates:
            raise ArgumentError(
                f"{path} trained a reward model: it scores text, it does not serve it."
            )
        if run.sections.tokenizer is None:
            raise ArgumentError(f"{path} has no tokenizer/ to encode prompts with.")
        return run.model(), run.sections.tokenizer, source.name
    from jaxtrain.hf import AutoModelForCausalLM

    if (source / "adapter_config.json").is_file():
        with tempfile.TemporaryDirectory(prefix="jaxtrain-serve-") as merged:
            base = merged_peft_directory(source, Path(merged))
            model = AutoModelForCausalLM.from_pretrained(merged)
        return model, _tokenizer(source, base), source.name
    model = AutoModelForCausalLM.from_pretrained(source)
    if source.suffix == ".gguf":  # its tokenizer is in its metadata
        from jaxtrain.hf import load_tokenizer

        return model, load_tokenizer(source), source.stem
    return model, _tokenizer(source), source.stem


def _tokenizer(*directories: Path) -> Any:
    from jaxtrain.hf.tokenizer_files import load_processing_class

    for directory in directories:
        if any(
            (directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            return load_processing_class(directory)
    raise ArgumentError(
        f"no tokenizer in {', '.join(map(str, directories))}: save one beside the model "
        "(tokenizer.json)."
    )


def merged_peft_directory(adapter_dir: Path, out: Path) -> Path:
    """A Hugging Face directory in `out` with the adapters of `adapter_dir` merged into its
    base's weights; returns the base directory."""
    from safetensors.numpy import load_file, save_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = Path(str(config.get("base_model_name_or_path") or ""))
    if not (base / "config.json").is_file():
        raise ArgumentError(
            f"{adapter_dir}/adapter_config.json names the base model {str(base)!r}, which is not "
            "a local Hugging Face directory; fix the path in that file (an absolute one works from "
            "any directory), or export the run merged (jaxtrain export without --lora_format peft)."
        )
    weights = sorted(base.glob("*.safetensors"))
    if not weights:
        raise ArgumentError(f"the base model {base} has no .safetensors weights to merge into.")
    tensors: dict[str, np.ndarray] = {}
    for file in weights:
        tensors.update(load_file(str(file)))
    adapters = load_file(str(adapter_dir / "adapter_model.safetensors"))
    scale = float(config["lora_alpha"]) / float(config["r"])
    transposed = bool(config.get("fan_in_fan_out"))  # GPT-2's Conv1D weights are [in, out]
    for key, a in adapters.items():
        if not key.endswith(".lora_A.weight"):
            continue
        stem = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]
        b = adapters[key.replace(".lora_A.", ".lora_B.")]
        name = f"{stem}.weight"
        if name not in tensors:
            raise ArgumentError(f"the adapter targets {name}, which {base} does not have.")
        delta = (b.astype(np.float32) @ a.astype(np.float32)) * scale  # [out, in]
        weight = tensors[name]
        merged = weight.astype(np.float32) + (delta.T if transposed else delta)
        tensors[name] = merged.astype(weight.dtype)
    for file in base.iterdir():
        if (
            file.is_file()
            and file.suffix != ".safetensors"
            and not file.name.endswith(".index.json")
        ):
            shutil.copy(file, out / file.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return base
