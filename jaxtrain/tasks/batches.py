"""The abstract batches of the tasks' train steps, from the arguments alone (what `jaxtrain
plan` compiles): [A, M, ...] jax.ShapeDtypeStructs, A the accumulation steps, M the micro
batch. JAX is imported when one is built, not with the task definitions."""

from __future__ import annotations

from typing import Any

from jaxtrain.errors import ArgumentError

__all__ = ["check_files_source", "lm_batch", "packed_units_batch", "pair_batch", "shapes"]

PAIR_KEYS = ("input_ids", "labels", "attention_mask")


def shapes(args: Any) -> tuple[Any, Any]:
    """(ints(*shape), floats(*shape)): builders of [A, M, *shape] int32 / float32 shapes."""
    import jax
    import jax.numpy as jnp

    a, m = args.gradient_accumulation_steps, args.micro_batch_size

    def ints(*shape: int) -> Any:
        return jax.ShapeDtypeStruct((a, m, *shape), jnp.int32)

    def floats(*shape: int) -> Any:
        return jax.ShapeDtypeStruct((a, m, *shape), jnp.float32)

    return ints, floats


def lm_batch(args: Any) -> dict[str, Any]:
    """Token rows of the causal LM loss (segment ids and positions when packed)."""
    ints, _ = shapes(args)
    keys = ["input_ids", "attention_mask", "labels"]
    if args.packing:
        keys += ["segment_ids", "positions"]
    return {k: ints(args.max_sequence_length) for k in keys}


def packed_units_batch(args: Any, *, labelled: bool = False) -> dict[str, Any]:
    """Rows of packed preference units (trainers/packed.py) and their per-unit slots."""
    import jax
    import jax.numpy as jnp

    from jaxtrain.trainers.packed import units_per_micro_batch

    ints, _ = shapes(args)
    t = args.max_sequence_length
    units = units_per_micro_batch(args.micro_batch_size, t)
    keys = (*PAIR_KEYS, "segment_ids", "positions", "sequence_index")
    batch = {k: ints(t) for k in keys}
    per_unit = jax.ShapeDtypeStruct((args.gradient_accumulation_steps, units), jnp.float32)
    batch["pair_mask"] = per_unit
    if labelled:
        batch["label"] = per_unit
    return batch


def pair_batch(args: Any) -> dict[str, Any]:
    """A chosen and a rejected sequence per row (packed: units of both)."""
    if args.packing:
        return packed_units_batch(args)
    ints, _ = shapes(args)
    t = args.max_sequence_length
    return {**{k: ints(t) for k in PAIR_KEYS}, **{f"rejected_{k}": ints(t) for k in PAIR_KEYS}}


def check_files_source(task: str, rows: str, config: dict[str, Any]) -> None:
    """A task whose rows the embedded corpus lacks needs data files: ArgumentError said in
    flags."""
    if (config.get("data") or {}).get("source", "default") != "files":
        raise ArgumentError(
            f"--task {task} trains on rows of {rows}: set --data.source files "
            "--data.train_files ROWS.jsonl (and --data.tokenizer DIR)."
        )
