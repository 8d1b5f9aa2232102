"""The abstract batches of the tasks' train steps, from a run's settings alone (what `jaxtrain
plan` compiles): [A, M, ...] jax.ShapeDtypeStructs, A the accumulation steps, M the micro
batch. JAX is imported when one is built, not with the task definitions."""

from __future__ import annotations

from typing import Any

from jaxtrain.config.sections import RunSettings
from jaxtrain.errors import ArgumentError

__all__ = [
    "check_files_source",
    "check_tokenizer",
    "lm_batch",
    "packed_units_batch",
    "pair_batch",
    "shapes",
]

PAIR_KEYS = ("input_ids", "labels", "attention_mask")


def shapes(settings: RunSettings) -> tuple[Any, Any]:
    """(ints(*shape), floats(*shape)): builders of [A, M, *shape] int32 / float32 shapes."""
    import jax
    import jax.numpy as jnp

    a, m = settings.data.accumulation_steps, settings.data.micro_batch_size

    def ints(*shape: int) -> Any:
        return jax.ShapeDtypeStruct((a, m, *shape), jnp.int32)

    def floats(*shape: int) -> Any:
        return jax.ShapeDtypeStruct((a, m, *shape), jnp.float32)

    return ints, floats


def lm_batch(settings: RunSettings) -> dict[str, Any]:
    """Token rows of the causal LM loss (segment ids and positions when packed)."""
    ints, _ = shapes(settings)
    keys = ["input_ids", "attention_mask", "labels"]
    if settings.data.packing:
        keys += ["segment_ids", "positions"]
    return {k: ints(settings.data.seq_len) for k in keys}


def packed_units_batch(settings: RunSettings, *, labelled: bool = False) -> dict[str, Any]:
    """Rows of packed preference units (trainers/packed.py) and their per-unit slots."""
    import jax
    import jax.numpy as jnp

    from jaxtrain.trainers.packed import units_per_micro_batch

    ints, _ = shapes(settings)
    data = settings.data
    t = data.seq_len
    units = units_per_micro_batch(data.micro_batch_size, t)
    keys = (*PAIR_KEYS, "segment_ids", "positions", "sequence_index")
    batch = {k: ints(t) for k in keys}
    per_unit = jax.ShapeDtypeStruct((data.accumulation_steps, units), jnp.float32)
    batch["pair_mask"] = per_unit
    if labelled:
        batch["label"] = per_unit
    return batch


def pair_batch(settings: RunSettings) -> dict[str, Any]:
    """A chosen and a rejected sequence per row (packed: units of both)."""
    if settings.data.packing:
        return packed_units_batch(settings)
    ints, _ = shapes(settings)
    t = settings.data.seq_len
    return {**{k: ints(t) for k in PAIR_KEYS}, **{f"rejected_{k}": ints(t) for k in PAIR_KEYS}}


def check_files_source(task: str, rows: str, config: dict[str, Any]) -> None:
    """A task whose rows the embedded corpus lacks needs data files, and a tokenizer for their
    text: ArgumentError said in flags."""
    if (config.get("data") or {}).get("source", "default") != "files":
        raise ArgumentError(
            f"--task {task} trains on rows of {rows}: set --data.source files "
            "--data.train_files ROWS.jsonl (and --data.tokenizer DIR)."
        )
    check_tokenizer(task, "the text of its rows", config)


def check_tokenizer(task: str, what: str, config: dict[str, Any]) -> None:
    """A task that tokenizes text from files needs a tokenizer the command can load: its own
    (`data.tokenizer`) or the pretrained model's. Without one the trainer failed on the first
    row, with the Python API's advice (pass processing_class=...)."""
    data, model = config.get("data") or {}, config.get("model") or {}
    if not data.get("tokenizer") and not model.get("pretrained"):
        raise ArgumentError(
            f"--task {task} tokenizes {what}: set --data.tokenizer DIR (a Hugging Face "
            "tokenizer directory), or --model.pretrained DIR (its tokenizer is used)."
        )
