"""Deciding where a run starts, and refusing to resume into something different.

A resume that cannot happen is an error that says what differs and how to proceed; a run
never falls back to a fresh start on its own (peers do, and users lose days to it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxtrain.checkpointing.files import (
    CheckpointError,
    checkpoints_root,
    committed_steps,
    find_checkpoint,
)
from jaxtrain.config.sections import CheckpointSettings

_MAX_LISTED = 8


def resume_checkpoint(settings: CheckpointSettings) -> Path | None:
    """The step directory this run continues from, or None for a fresh start.

    - `resume_from` names one explicitly (it must exist);
    - otherwise, with `resume_if_possible`, the newest committed checkpoint in output_dir;
    - `overwrite_output_dir` asks for a fresh start and wins over `resume_if_possible`.
    """
    if settings.resume_from is not None:
        return find_checkpoint(settings.resume_from)
    if settings.overwrite_output_dir or not settings.resume_if_possible:
        return None  # prepare_output_dir refuses old checkpoints unless overwriting
    root = checkpoints_root(settings.output_dir)
    steps = committed_steps(root)
    return root / str(steps[-1]) if steps else None


def _differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(current))
    return [
        f"{key}: checkpoint {saved.get(key)!r}, now {current.get(key)!r}"
        for key in keys
        if saved.get(key) != current.get(key)
    ]


def check_compatible(
    metadata: dict[str, Any],
    *,
    path: Path,
    model_class: str,
    model_config: dict[str, Any] | None,
    optimizer: str,
    reset_optimizer: bool,
    loading: bool = False,
    trainer_name: str | None = None,
) -> None:
    """Raise CheckpointError when the checkpoint at `path` was written by another task's
    trainer (`trainer_name`: its class, a task's own; None, or a checkpoint that predates the
    record: not checked), or for another model or optimizer than this run's; the message says
    what differs and the ways forward (those of a resume, or with `loading` those of
    `Trainer.load_checkpoint`: eval, sample, export)."""
    saved_trainer = metadata.get("trainer")
    if trainer_name is not None and saved_trainer not in (None, trainer_name):
        written = f"it was written by {saved_trainer}, and this run's trainer is {trainer_name}"
        if loading:
            raise CheckpointError(
                f"Cannot load {path}: {written}. Load it with {saved_trainer} "
                "(`jaxtrain eval|sample|export RUN_DIR` rebuild the run's own from its "
                "config.yaml)."
            )
        raise CheckpointError(
            f"Cannot resume from {path}: {written} (another --task; a run goes on under the "
            "objective it began with). To train this task from that model, export it "
            "(`jaxtrain export RUN_DIR OUT`) and start a run with --model.pretrained OUT in a "
            "new output_dir."
        )
    problems = []
    if metadata.get("model_class") not in (None, model_class):
        problems.append(f"model class: checkpoint {metadata['model_class']}, now {model_class}")
    saved_config = metadata.get("model_config")
    if saved_config is not None and model_config is not None:
        # JSON turned tuples into lists; compare like with like.
        current = json.loads(json.dumps(model_config))
        problems += [f"model.{d}" for d in _differences(saved_config, current)]
    if problems:
        listed = "; ".join(problems[:_MAX_LISTED])
        more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
        if loading:
            raise CheckpointError(
                f"Cannot load {path}: it was written for a different model ({listed}{more}). "
                "Build the Trainer with the model of the run that wrote it (its class and "
                "config are in the checkpoint's meta/metadata; `jaxtrain eval|sample|export "
                "RUN_DIR` rebuild it from the run's config.yaml)."
            )
        raise CheckpointError(
            f"Cannot resume from {path}: it was written for a different model ({listed}{more}). "
            "Use the model configuration of that run, or start a new run: pass "
            "--resume_if_possible false with a new output_dir, or --overwrite_output_dir true "
            "to discard the old checkpoints."
        )
    saved_optimizer = (metadata.get("arguments") or {}).get("optimizer")
    if saved_optimizer not in (None, optimizer) and loading:
        raise CheckpointError(
            f"Cannot load {path}: its optimizer state is {saved_optimizer!r} but this Trainer "
            f"uses {optimizer!r}. Set optimizer={saved_optimizer!r} to load it."
        )
    if saved_optimizer not in (None, optimizer) and not reset_optimizer:
        raise CheckpointError(
            f"Cannot resume from {path}: its optimizer state is {saved_optimizer!r} but this run "
            f"uses {optimizer!r}. Pass --reset_optimizer true to keep the parameters, step and "
            "data position with a fresh optimizer state, or go back to the old optimizer."
        )


# The arguments that shape the learning-rate schedule (training/optim.py build_schedule).
SCHEDULE_FIELDS = ("scheduler", "learning_rate", "warmup_steps", "max_steps", "num_train_epochs",
                   "min_lr_ratio", "wsd_decay_fraction")  # fmt: skip


def schedule_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> str | None:
    """What a resumed run changed of the learning-rate schedule since its checkpoint ("max_steps
    5 -> 10"), or None: the schedule is rebuilt from the current arguments, so a longer run
    stretches it (the step's learning rate is not the checkpointed run's), which is what a
    user extending a run usually wants, but it must be said."""
    if not saved:
        return None
    fields = SCHEDULE_FIELDS
    if saved.get("scheduler") == current.get("scheduler") == "constant":  # no length to it
        fields = ("learning_rate", "warmup_steps")
    changed = [
        f"{name} {saved[name]} -> {current[name]}"
        for name in fields
        if name in saved and name in current and saved[name] != current[name]
    ]
    return ", ".join(changed) or None


# The arguments of every task that shape its updates (beyond the schedule): a resumed run that
# changes one trains on with it, which must be said. A task's own fields (beta, distill_alpha,
# ...) are added by the caller.
UPDATE_FIELDS = ("weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "momentum",
                 "clip_grad", "mu_dtype", "max_sequence_length", "truncation_mode",
                 "completion_only_loss", "chat_template", "lora_dropout")  # fmt: skip


def setting_changes(
    saved: dict[str, Any] | None, current: dict[str, Any], task_fields: tuple[str, ...] = ()
) -> str | None:
    """What a resumed run changed of the settings that shape its updates ("beta 0.1 -> 0.5"),
    or None. Said, not refused: going on with another beta or weight decay is a choice."""
    if not saved:
        return None
    changed = [
        f"{name} {saved[name]!r} -> {current[name]!r}"
        for name in (*task_fields, *UPDATE_FIELDS)
        if name in saved and name in current and saved[name] != current[name]
    ]
    return ", ".join(changed) or None


def trim_metric_log(path: Path, last_step: int) -> None:
    """Drop records of steps after `last_step` (logged by the interrupted run after its last
    checkpoint): the resumed run logs those steps again, and curves must not double back."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line).get("step", 0)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill -9; its step was never checkpointed either
        if step <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
