"""The `model.pretrained` section: fine-tuning a local Hugging Face model from the CLI."""

from __future__ import annotations

from typing import Any

from jaxtrain.errors import ArgumentError, HFError


def pretrained_data_section(model_section: dict[str, Any], data: dict[str, Any]) -> dict:
    """With `model.pretrained` and no `data.tokenizer`, the model directory's tokenizer is the
    run's tokenizer (a pretrained model must see its own token ids)."""
    path = model_section.get("pretrained")
    if not path:
        return data
    check_pretrained_section(model_section)  # before any data is read or model loaded
    if data.get("tokenizer"):
        return data
    from jaxtrain.hf.load import TOKENIZER_FILES, gguf_path, resolve_model_dir

    if gguf_path(path) is not None:  # a llama.cpp file carries its tokenizer
        return {**data, "tokenizer": str(path)}
    model_dir = resolve_model_dir(path)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return data
    return {**data, "tokenizer": str(model_dir)}


def pretrained_load_options(args: Any) -> dict[str, Any]:
    """How a run reads `model.pretrained` weights: in its param_dtype, and a QLoRA run's base
    quantized as it is read (tensor by tensor: no float copy of the whole model)."""
    import jax.numpy as jnp

    options: dict[str, Any] = {"param_dtype": jnp.dtype(args.param_dtype or "float32")}
    if args.quantization and args.lora_rank:
        from jaxtrain.quantization import BaseQuantization

        options["quantization"] = BaseQuantization(
            args.quantization, args.quantization_block_size, args.quantization_double
        )
    return options


def build_pretrained_model(
    values: dict[str, Any],
    tokenizer: Any,
    sharding_for: Any = None,
    load_options: dict[str, Any] | None = None,
):
    """The model of a `model: {pretrained: DIR}` section: the architecture comes from
    DIR/config.json, so other model keys are refused (the demo defaults are ignored).
    `load_options` (pretrained_load_options) go to from_pretrained."""
    from jaxtrain.data.vision import text_tokenizer
    from jaxtrain.hf.load import from_pretrained

    path = check_pretrained_section(values)
    model = from_pretrained(str(path), sharding_for=sharding_for, **(load_options or {}))
    tokenizer = text_tokenizer(tokenizer)
    if tokenizer is not None and model.config.vocab_size < len(tokenizer):
        raise HFError(
            f"{path}: vocab_size={model.config.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({len(tokenizer)}); use the model's own tokenizer (unset data.tokenizer)."
        )
    return model


def check_pretrained_section(values: dict[str, Any]) -> str:
    """The `model.pretrained` path; ArgumentError if the section also sets architecture keys."""
    from jaxtrain.cli.run_config import DEFAULT_CONFIG

    # The CLI merges the demo's model section under the user's: those values are not choices.
    demo = DEFAULT_CONFIG["model"]
    others = sorted(k for k, v in values.items() if k != "pretrained" and demo.get(k, ...) != v)
    if others:
        raise ArgumentError(
            f"model.pretrained={values['pretrained']!r} takes the architecture from its "
            f"config.json; remove model.{', model.'.join(others)} from the config."
        )
    return str(values["pretrained"])


def run_model_section(model: Any) -> dict[str, Any]:
    """The `model` section saved in a run's config.yaml: the full config, plus the base
    model's path (for the model card) when the weights came from a pretrained directory."""
    section = model.config.to_dict()
    base = getattr(model, "name_or_path", None)
    if base:
        section["base_model"] = str(base)
    return section
