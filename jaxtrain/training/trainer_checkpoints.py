"""The Trainer's checkpoint side: where `train()` starts, saving, loading.

`TrainerCheckpoints` is mixed into `Trainer` (trainer.py); it uses the Trainer's
`arguments`, `model`, `model_config`, `optimizer`, `train_loader`, `checkpoints`, `monitor`,
`hooks`, `create_state()` and `abstract_state()`. The files themselves are
`jaxtrain.checkpointing`'s, which knows nothing of the Trainer: this is where the two meet.

A task trainer that holds more than the train state between steps (GRPO's generated batch,
reused by the updates of a round) keeps it in the same checkpoint through
`checkpoint_extra` (what to save, asked at every save) and `resume_extra` (given it back
before the first resumed step).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxtrain.checkpointing import (
    CheckpointSettings,
    RunCheckpoints,
    RunStart,
    StartPlan,
    load_checked,
    restore_extra,
)
from jaxtrain.parallel.distributed import gather_json
from jaxtrain.state import TrainState
from jaxtrain.training.state import ReadyBuild, StagedBuild


class TrainerCheckpoints:
    """Checkpoint methods of the Trainer (see the module docstring for what they use)."""

    def save_checkpoint(self, state: TrainState, *, evaluated: bool = False) -> str:
        """Start a background save of `state` under output_dir/checkpoints/<step>; returns
        that step directory. `self.checkpoints.wait()` blocks until it is committed.
        `evaluated`: the run has evaluated (and logged) this step already."""
        step = int(jax.device_get(state.step))
        metadata = {**self._checkpoint_metadata(step), "evaluated": evaluated}
        extra = self.checkpoint_extra(step)
        arrays = None
        if extra is not None:
            metadata["extra"], arrays = extra
        path = self.checkpoints.save(state, metadata=metadata, extra=arrays)
        self.hooks.call("on_save", self, str(path), step)
        return str(path)

    def checkpoint_extra(self, step: int) -> tuple[dict[str, Any], Any] | None:
        """What a subclass keeps in the checkpoint of `step` beside the train state: (JSON
        details, a pytree of global arrays), written in the same atomic commit (the details
        in its metadata, the arrays as its `extra` item). None (the default): nothing."""
        return None

    def resume_extra(
        self, details: dict[str, Any], restore: Callable[[Any], Any], step: int
    ) -> None:
        """Given back what `checkpoint_extra` saved in the checkpoint `train()` resumes at
        `step`, before its first step: `details` as saved, and `restore(abstract)` reads the
        arrays onto `abstract` (ShapeDtypeStructs with this run's shardings). Only called for
        a checkpoint that has them; the default ignores them."""

    def _checkpoint_metadata(self, step: int) -> dict[str, Any]:
        metadata = {
            "step": step,
            "arguments": self.arguments.to_dict(),
            "model_config": self._model_config_dict(),
            "model_class": type(self.model).__name__,
            "trackers": self.monitor.tracker_state(),
        }
        if self.train_loader is not None:
            data_state = self.train_loader.data_state(step)
            if jax.process_count() > 1 and self.train_loader.state_is_per_process:
                # Streams and packing: each process knows only its own position.
                data_state = {"step": step, "processes": gather_json(data_state)}
            metadata["data_state"] = data_state
        return metadata

    def load_checkpoint(self, path: str | Path) -> TrainState:
        """Restore a TrainState written by this kind of Trainer (same model and optimizer).

        `path` is a step directory or a run directory (its newest committed checkpoint).
        """
        return load_checked(
            path,
            self.abstract_state(),
            model_class=type(self.model).__name__,
            model_config=self._model_config_dict(),
            optimizer=self.arguments.optimizer,
        )

    def plan_start(self) -> StartPlan:
        """Where `train()` starts: step 0, or the checkpoint it resumes, checked (model,
        optimizer, data position) but not yet restored. Clears or refuses output_dir's old
        checkpoints as `jaxtrain.checkpointing.run` describes."""
        settings = CheckpointSettings.from_arguments(self.arguments)
        if settings != self.checkpoints.settings:  # arguments changed since the Trainer was built
            self.checkpoints = RunCheckpoints(settings)
        loader = self.train_loader
        return self.checkpoints.plan(
            model_class=type(self.model).__name__,
            model_config=self._model_config_dict(),
            check_data_state=loader.check_data_state if loader is not None else None,
        )

    def start_state(
        self, plan: StartPlan | None = None, *, fresh: StagedBuild | ReadyBuild | None = None
    ) -> RunStart:
        """`plan` (default: `plan_start()`) with its state: a fresh state built around the
        model's arrays (by `fresh`, a `stage_state(copy=False)`, when given), or the
        checkpoint restored onto this Trainer's shardings (its extra arrays, if it has
        any, handed to `resume_extra`)."""
        start = self.checkpoints.load(
            plan if plan is not None else self.plan_start(),
            fresh_state=lambda: (fresh or self.stage_state(copy=False)).run(),
            abstract_state=self.abstract_state,
            init_optimizer=self.optimizer.init,
        )
        path = start.resumed_from
        if path is not None and start.extra is not None:
            self.resume_extra(
                start.extra, lambda abstract: restore_extra(path, abstract), start.step
            )
        return start

    def _model_config_dict(self) -> dict[str, Any] | None:
        config = self.model_config
        return config.to_dict() if hasattr(config, "to_dict") else None
