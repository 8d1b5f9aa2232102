"""README.md model card for an exported model: what it is and how it was trained."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from jaxtrain.config.sections import MonitorSettings


def training_summary(
    run: MonitorSettings,
    model: Any,
    state: Any,
    dataset_train: Any = None,
    dataset_eval: Any = None,
) -> dict[str, Any]:
    """Facts about a run for the card: base model, data, steps, losses, arguments (`run`: its
    files and the arguments as recorded)."""
    summary: dict[str, Any] = {
        "base_model": getattr(model, "name_or_path", None),
        "steps": int(jax.device_get(state.step)),
        "arguments": run.config,
        "data": describe_dataset(dataset_train),
        "eval_data": describe_dataset(dataset_eval),
    }
    log = Path(run.output_dir) / "metrics.jsonl"
    summary["final_metrics"] = final_metrics(log, up_to_step=summary["steps"])
    return summary


def describe_dataset(dataset: Any) -> str | None:
    if dataset is None:
        return None
    if isinstance(dataset, Mapping):  # a mixture: each source
        parts = [
            f"{name}: {describe_dataset(getattr(d, 'data', d))}" for name, d in dataset.items()
        ]
        return "mixture of " + "; ".join(parts)
    parts = [type(dataset).__name__]
    info = getattr(dataset, "info", None)
    name = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None)
    if name:
        parts.append(f"'{name}'")
    with contextlib.suppress(TypeError):
        parts.append(f"{len(dataset)} rows")
    return ", ".join(parts)


def final_metrics(metrics_log: Path, *, up_to_step: int | None = None) -> dict[str, float]:
    """The last logged value of each loss-like metric in a run's metrics.jsonl (records
    after ``up_to_step`` are skipped: an older checkpoint's card shows its own losses)."""
    found: dict[str, float] = {}
    if not metrics_log.is_file():
        return found
    for line in metrics_log.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if up_to_step is not None and record.get("step", 0) > up_to_step:
            continue
        for key in ("loss", "eval/loss", "eval/perplexity", "eval/accuracy"):
            if isinstance(record.get(key), (int, float)):
                found[key] = float(record[key])
    return found


def render_model_card(
    config: Any, hf_config: dict[str, Any], summary: dict[str, Any], task: str = "causal-lm"
) -> str:
    base = summary.get("base_model")
    tag = "text-generation" if task == "causal-lm" else task
    front = ["---", "library_name: transformers", f"tags: [jaxtrain, {tag}]"]
    if base:
        front.append(f"base_model: {json.dumps(str(base))}")
    front.append("---")
    n_params = config.num_parameters()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    auto = "AutoModelForCausalLM" if task == "causal-lm" else "AutoModelForImageClassification"
    vocab = (
        f"vocabulary {config.vocab_size}"
        if hasattr(config, "vocab_size")
        else f"{getattr(config, 'num_labels', '?')} labels"
    )
    lines = [
        *front,
        "",
        f"# {hf_config['architectures'][0]} trained with jaxtrain",
        "",
        f"- Architecture: `{hf_config['model_type']}`, {n_params / 1e6:.2f}M parameters, "
        f"{config.num_hidden_layers} layers, hidden size {config.hidden_size}, "
        f"{heads} heads ({kv_heads} key/value heads), {vocab}.",
        f"- Base model: {base if base else 'none (trained from random initialisation)'}",
    ]
    if summary.get("data"):
        lines.append(f"- Training data: {summary['data']}")
    if summary.get("eval_data"):
        lines.append(f"- Evaluation data: {summary['eval_data']}")
    if summary.get("steps") is not None:
        lines.append(f"- Training steps: {summary['steps']}")
    for key, value in (summary.get("final_metrics") or {}).items():
        lines.append(f"- Final {key}: {value:.4f}")
    lines += [
        "",
        "## Usage",
        "",
        "```python",
        f"from transformers import {auto}",
        f'model = {auto}.from_pretrained("path/to/this/directory")',
        "```",
        "",
        "or in jaxtrain: `jaxtrain.hf.from_pretrained(path)`.",  # any registered model_type
    ]
    if summary.get("arguments"):
        lines += [
            "",
            "## Training arguments",
            "",
            "```json",
            json.dumps(summary["arguments"], indent=2, sort_keys=True, default=str),
            "```",
        ]
    return "\n".join(lines) + "\n"


def type_name(config: Any) -> str:
    """The jaxtrain class that loads a model of this config."""
    from jaxtrain.hf.registry import family_of

    return family_of(config).model_class.__name__
