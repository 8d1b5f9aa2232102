"""The CLI's Hugging Face pieces: `jaxtrain export` and the `model.pretrained` option."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxtrain.hf.errors import HFError

EXPORT_USAGE = "jaxtrain export RUN_OR_CHECKPOINT OUT_DIR [--max_shard_size 5GB] [--dtype bfloat16]"


def pretrained_data_section(model_section: dict[str, Any], data: dict[str, Any]) -> dict:
    """With `model.pretrained` and no `data.tokenizer`, the model directory's tokenizer is the
    run's tokenizer (a pretrained model must see its own token ids)."""
    path = model_section.get("pretrained")
    if not path:
        return data
    _check_pretrained_section(model_section)  # before any data is read or model loaded
    if data.get("tokenizer"):
        return data
    from jaxtrain.hf.load import TOKENIZER_FILES, resolve_model_dir

    model_dir = resolve_model_dir(path)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        return data
    return {**data, "tokenizer": str(model_dir)}


def build_pretrained_model(values: dict[str, Any], tokenizer: Any, sharding_for: Any = None):
    """The model of a `model: {pretrained: DIR}` section: the architecture comes from
    DIR/config.json, so other model keys are refused (the demo defaults are ignored)."""
    from jaxtrain.hf.load import from_pretrained

    path = _check_pretrained_section(values)
    model = from_pretrained(str(path), sharding_for=sharding_for)
    if tokenizer is not None and model.config.vocab_size < len(tokenizer):
        raise HFError(
            f"{path}: vocab_size={model.config.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({len(tokenizer)}); use the model's own tokenizer (unset data.tokenizer)."
        )
    return model


def _check_pretrained_section(values: dict[str, Any]) -> str:
    """The `model.pretrained` path; ArgumentError if the section also sets architecture keys."""
    from jaxtrain.arguments import ArgumentError
    from jaxtrain.run_config import DEFAULT_CONFIG

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


def locate_run(source: str) -> tuple[Path, Path | None]:
    """(run directory, checkpoint step directory or None for the newest) of RUN_OR_CHECKPOINT."""
    from jaxtrain.arguments import ArgumentError

    path = Path(source)
    if (path / "config.yaml").is_file():
        return path, None
    if (path / "state").is_dir() and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent, path
    raise ArgumentError(
        f"{source} is neither a run directory (with config.yaml) nor a checkpoint step "
        "directory (<run>/checkpoints/<step>) of one."
    )


def _check_writable(out_dir: Path) -> None:
    """Refuse an OUT_DIR that cannot be created or written, naming it and the reason."""
    from jaxtrain.errors import HFError

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".jaxtrain-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise HFError(
            f"cannot write to {out_dir}: {err.strerror or err} ({type(err).__name__}). "
            "Nothing was exported; choose a directory you can write to."
        ) from err


def cmd_export(tokens: list[str]) -> int:
    from jaxtrain.arguments import ArgumentError
    from jaxtrain.cli import _restore_run
    from jaxtrain.hf.model_card import final_metrics
    from jaxtrain.run_config import parse_overrides

    positional = []
    while tokens and not tokens[0].startswith("--") and len(positional) < 2:
        positional.append(tokens.pop(0))
    if len(positional) != 2:
        raise ArgumentError(f"expected RUN_OR_CHECKPOINT and OUT_DIR.\nusage: {EXPORT_USAGE}")
    run_dir, checkpoint = locate_run(positional[0])
    _check_writable(Path(positional[1]))  # before the checkpoint is read
    options = parse_overrides(tokens)
    unknown = sorted(set(options) - {"max_shard_size", "dtype"})
    if unknown:
        raise ArgumentError(f"jaxtrain export: unknown option(s) {unknown}.\nusage: {EXPORT_USAGE}")
    restore = [str(run_dir)] + (["--checkpoint", str(checkpoint)] if checkpoint else [])
    trainer, state, checkpoint_path, _, tokenizer, _ = _restore_run(restore, with_eval_data=False)
    from jaxtrain.arguments import read_config_file

    data = read_config_file(run_dir / "config.yaml").get("data") or {}
    steps = int(state.step)
    summary = {
        "data": ", ".join(f"{k}={v}" for k, v in data.items()) or None,
        "final_metrics": final_metrics(run_dir / "metrics.jsonl", up_to_step=steps),
    }
    out = trainer.save_pretrained(
        state, positional[1], tokenizer=tokenizer, training_summary=summary, **options
    )
    print(f"exported {checkpoint_path} (step {steps}) to {out}")
    return 0
