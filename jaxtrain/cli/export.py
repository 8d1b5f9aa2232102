"""`jaxtrain export RUN_OR_CHECKPOINT OUT_DIR`: a run as a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

from jaxtrain.cli.usage import EXPORT_USAGE
from jaxtrain.errors import ArgumentError, HFError


def locate_run(source: str) -> tuple[Path, Path | None]:
    """(run directory, checkpoint step directory or None for the newest) of RUN_OR_CHECKPOINT."""
    path = Path(source)
    if (path / "config.yaml").is_file():
        return path, None
    if (path / "state").is_dir() and (path.parent.parent / "config.yaml").is_file():
        return path.parent.parent, path
    from jaxtrain.cli.run_dir import python_run_error

    for run_dir in (path, path.parent.parent):
        if error := python_run_error(run_dir):
            raise error
    raise ArgumentError(
        f"{source} is neither a run directory (with config.yaml) nor a checkpoint step "
        "directory (<run>/checkpoints/<step>) of one."
    )


def _check_writable(out_dir: Path) -> None:
    """Refuse an OUT_DIR that cannot be created or written, naming it and the reason."""
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
    from jaxtrain.cli.run_config import parse_overrides
    from jaxtrain.cli.run_dir import restore_run
    from jaxtrain.config_values import read_config_file
    from jaxtrain.hf.model_card import final_metrics

    tokens = list(tokens)
    positional = []
    while tokens and not tokens[0].startswith("--") and len(positional) < 2:
        positional.append(tokens.pop(0))
    if len(positional) != 2:
        raise ArgumentError(f"expected RUN_OR_CHECKPOINT and OUT_DIR.\nusage: {EXPORT_USAGE}")
    run_dir, checkpoint = locate_run(positional[0])
    _check_writable(Path(positional[1]))  # before the checkpoint is read
    options = parse_overrides(tokens)
    dims = options.pop("sharding_axis_dims", None)  # default: the run's mesh, where it fits
    unknown = sorted(set(options) - {"max_shard_size", "dtype", "lora_format"})
    if unknown:
        raise ArgumentError(f"jaxtrain export: unknown option(s) {unknown}.\nusage: {EXPORT_USAGE}")
    run = restore_run(run_dir, checkpoint, sharding_axis_dims=dims)
    data = read_config_file(run_dir / "config.yaml").get("data") or {}
    steps = int(run.state.step)
    summary = {
        "data": ", ".join(f"{k}={v}" for k, v in data.items()) or None,
        "final_metrics": final_metrics(run_dir / "metrics.jsonl", up_to_step=steps),
    }
    out = run.save_pretrained(positional[1], training_summary=summary, **options)
    print(f"exported {run.checkpoint} (step {steps}) to {out}")
    return 0
