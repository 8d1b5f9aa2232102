"""EasyDeL argument names a newcomer may bring, each with what jaxtrain calls it.

One table, read by TrainingArguments (Python keyword arguments, YAML/JSON config files and
`--flag value` on the command line all pass through it) and listed in the docs' "Coming
from EasyDeL" section (tests/test_seed_names.py keeps the two in step). No imports.
"""

from __future__ import annotations

__all__ = ["SEED_ARGUMENT_NAMES", "seed_name_hint"]

# EasyDeL name -> (the jaxtrain spelling, a note). An empty spelling: no counterpart, and
# the note says why.
SEED_ARGUMENT_NAMES: dict[str, tuple[str, str]] = {
    "per_device_train_batch_size": (
        "total_batch_size",
        "the global rows per optimizer update; jaxtrain splits them over the data-parallel "
        "devices and gradient_accumulation_steps",
    ),
    "per_device_eval_batch_size": ("eval_batch_size", "rows per eval batch, all devices"),
    "sharding_array": ("sharding_axis_dims", "mesh sizes of dp, fsdp, ep, tp, sp: 1,-1,1,1,1"),
    "use_wandb": ("report_to: [wandb]", "on the command line --report_to jsonl,wandb"),
    "save_directory": ("output_dir", "checkpoints go to output_dir/checkpoints/STEP"),
    "report_steps": ("logging_steps", ""),
    "log_steps": ("logging_steps", ""),
    "evaluation_steps": ("eval_steps", ""),
    "max_evaluation_steps": ("max_eval_batches", ""),
    "max_training_steps": ("max_steps", ""),
    "max_length": ("max_sequence_length", ""),
    "accumulate_steps": ("gradient_accumulation_steps", ""),
    "progress_bar_type": ("progress_bar", "rich, tqdm, json or none"),
    "save_strategy": (
        "save_steps",
        "a checkpoint every N steps (unset: only the final save); save_interval_minutes "
        "saves by wall time",
    ),
    "model_name": ("run_name", "the run's name in trackers; files go to output_dir"),
    "log_weight_distribution": ("weight_distribution_log_steps", "a cadence in steps"),
    "attn_dtype": ("dtype", "one compute dtype for the whole model"),
    "partition_axis": ("sharding_rules", "logical axis name -> mesh axis"),
    "use_fast_kernels": (
        "",
        "set `model.attention_implementation = 'cudnn'` on the model in Python for the fused "
        "attention kernel of NVIDIA GPUs",
    ),
    "attn_softmax_dtype": ("", "the attention softmax always runs in float32"),
    "sharding_axis_names": ("", "the mesh axes are always dp, fsdp, ep, tp, sp"),
}


def seed_name_hint(name: str) -> str | None:
    """What jaxtrain calls the EasyDeL argument `name`, in one sentence; None if unknown."""
    if name not in SEED_ARGUMENT_NAMES:
        return None
    spelling, note = SEED_ARGUMENT_NAMES[name]
    if not spelling:
        return f"`{name}` is not a jaxtrain argument: {note}"
    return f"`{name}` is `{spelling}` in jaxtrain" + (f" ({note})" if note else "")
