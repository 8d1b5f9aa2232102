"""Where a run starts: a resume when one is asked for or possible, else a fresh state.

Never a silent fresh start: a resume that cannot happen is an error (see `resume.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxtrain.training import checkpoint as ckpt
from jaxtrain.training import resume
from jaxtrain.training.state import TrainState

if TYPE_CHECKING:
    from jaxtrain.training.trainer import Trainer


def initial_state(trainer: Trainer) -> tuple[TrainState, int, Path | None]:
    """(state, step, checkpoint resumed from or None) for `trainer.train()`.

    A fresh start clears output_dir's leftovers (refusing committed checkpoints unless
    overwrite_output_dir); a resume checks the checkpoint was written for this model,
    optimizer and data, then restores onto the trainer's abstract state (its shardings).
    """
    args = trainer.arguments
    path = resume.resume_checkpoint(args)
    if path is None:
        root = ckpt.checkpoints_root(args.output_dir)
        refused = bool(ckpt.committed_steps(root)) and not args.overwrite_output_dir
        # One process clears leftovers while the others wait; a refusal raises everywhere.
        if jax.process_index() == 0 or refused:
            ckpt.prepare_output_dir(args.output_dir, overwrite=args.overwrite_output_dir)
            (Path(args.output_dir) / "metrics.jsonl").unlink(missing_ok=True)
        _barrier("jaxtrain_prepare_output_dir")
        return trainer.create_state(), 0, None
    own_root = ckpt.checkpoints_root(args.output_dir)
    if path.parent != own_root and ckpt.committed_steps(own_root):
        raise ckpt.CheckpointError(
            f"resume_from={args.resume_from} is another run's checkpoint, but output_dir "
            f"{args.output_dir} already holds checkpoints of its own. Choose a new "
            "output_dir for the resumed run."
        )
    metadata = ckpt.read_metadata(path)
    config = trainer.model_config
    resume.check_compatible(
        metadata,
        path=path,
        model_class=type(trainer.model).__name__,
        model_config=config.to_dict() if hasattr(config, "to_dict") else None,
        optimizer=args.optimizer,
        reset_optimizer=args.reset_optimizer,
    )
    step = int(metadata["step"])
    trainer._monitor.resume_state = metadata.get("trackers") or {}  # same TB dir, W&B run
    if "data_state" in metadata and trainer.train_loader is not None:
        data_step = trainer.train_loader.check_data_state(metadata["data_state"])
        if data_step != step:
            raise ckpt.CheckpointError(
                f"{path}: its data position (step {data_step}) does not match its train "
                f"state (step {step}); the checkpoint is inconsistent. Resume from another."
            )
    abstract = trainer.abstract_state()
    if args.reset_optimizer:
        params = ckpt.restore_params(path, abstract.params)
        opt_state = jax.jit(trainer.optimizer.init)(params)
        state = TrainState(step=jnp.asarray(step, jnp.int32), params=params, opt_state=opt_state)
    else:
        state = ckpt.restore_state(path, abstract)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0:
        resume.trim_metric_log(Path(args.output_dir) / "metrics.jsonl", step)
    _barrier("jaxtrain_resume")
    return state, step, path


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
