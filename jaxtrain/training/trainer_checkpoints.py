"""A run's side of its checkpoints: where `train()` starts, saving, loading, the run's files.

`RunCheckpointer` joins the checkpoint files (`jaxtrain.checkpointing`, which knows nothing of
a run) with what a run saves: the Program's state, the batch source's position (and any
arrays the source keeps between steps: GRPO's generated batch inside a round, through the
source's `checkpoint_extra` / `resume_extra`), the arguments, the model's description, the trainer (so that a run
never resumes under another task's objective) and the trackers' state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from jaxtrain.checkpointing import (
    RunCheckpoints,
    RunStart,
    StartPlan,
    load_checked,
    restore_extra,
)
from jaxtrain.checkpointing.compat import schedule_changes, setting_changes
from jaxtrain.config.sections import CheckpointSettings
from jaxtrain.parallel.distributed import gather_json
from jaxtrain.state import TrainState
from jaxtrain.training.state import ReadyBuild, StagedBuild

__all__ = ["RunCheckpointer", "library_class", "load_program_state"]


class RunCheckpointer:
    """The checkpoints of one run (see the module docstring)."""

    def __init__(
        self,
        settings: CheckpointSettings,
        arguments: Any,
        program: Any,
        source: Any,
        monitor: Any,
        *,
        on_save: Callable[[str, int], None] = lambda path, step: None,
        tokenizer: Any = None,
        initial_state: TrainState | None = None,
        trainer_class: type | None = None,
    ):
        self.arguments, self.program, self.source, self.monitor = (
            arguments,
            program,
            source,
            monitor,
        )
        self.on_save, self.tokenizer = on_save, tokenizer
        self.initial_state = initial_state
        self.trainer = None if trainer_class is None else library_class(trainer_class)
        # `arguments`, the run's record, is written as such (arguments.json, each checkpoint).
        self.files = RunCheckpoints(settings)

    @property
    def root(self) -> Path:
        return self.files.root

    def close(self) -> None:
        """Wait for the background writes to commit."""
        self.files.close()

    def write_run_files(self) -> None:
        """arguments.json and the tokenizer in output_dir (process 0 writes them)."""
        out_dir = Path(self.files.settings.output_dir)
        self.arguments.save(out_dir / "arguments.json")
        if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(out_dir / "tokenizer")

    def save(self, state: TrainState, *, evaluated: bool = False) -> str:
        """Start a background save of `state` under output_dir/checkpoints/<step>; returns
        that step directory. `close()` blocks until it is committed. `evaluated`: the run has
        evaluated (and logged) this step already."""
        step = int(jax.device_get(state.step))
        metadata = {**self._metadata(step), "evaluated": evaluated}
        extra = self.source.checkpoint_extra(step) if self.source is not None else None
        arrays = None
        if extra is not None:
            metadata["extra"], arrays = extra
        path = self.files.save(state, metadata=metadata, extra=arrays)
        self.on_save(str(path), step)
        return str(path)

    def _metadata(self, step: int) -> dict[str, Any]:
        metadata = {
            "step": step,
            "arguments": self.arguments.to_dict(),
            "model_config": self._model_config(),
            "model_class": type(self.program.model).__name__,
            "trainer": self.trainer,
            "trackers": self.monitor.tracker_state(),
        }
        if self.source is not None:
            data_state = self.source.data_state(step)
            if jax.process_count() > 1 and self.source.state_is_per_process:
                # Streams and packing: each process knows only its own position.
                data_state = {"step": step, "processes": gather_json(data_state)}
            metadata["data_state"] = data_state
        return metadata

    def load(self, path: str | Path) -> TrainState:
        """Restore a TrainState written by this kind of run (same model and optimizer);
        `path` is a step directory or a run directory (its newest committed checkpoint)."""
        return load_program_state(
            self.program, path, optimizer=self.files.settings.optimizer, trainer_name=self.trainer
        )

    def plan_start(self) -> StartPlan:
        """Where `train()` starts: step 0 (or the given initial state's step), or the
        checkpoint it resumes, checked (model, optimizer, data position) but not yet
        restored. Clears or refuses output_dir's old checkpoints as
        `jaxtrain.checkpointing.run` describes."""
        source = self.source
        plan = self.files.plan(
            model_class=type(self.program.model).__name__,
            model_config=self._model_config(),
            check_data_state=source.check_data_state if source is not None else None,
            trainer_name=self.trainer,
        )
        current = self.arguments.to_dict()
        changed = schedule_changes(plan.saved_arguments, current)
        if changed:
            plan.notes.append(
                f"the learning-rate schedule follows this run's arguments ({changed}), not the "
                f"checkpoint's: from step {plan.step + 1} on its rates are the new schedule's"
            )
        changed = setting_changes(plan.saved_arguments, current, task_fields(self.arguments))
        if changed:
            plan.notes.append(
                f"this run's settings differ from the checkpoint's ({changed}): its updates "
                f"from step {plan.step + 1} on follow this run's"
            )
        if plan.resumed_from is None and self.initial_state is not None:
            plan.step = int(jax.device_get(self.initial_state.step))  # it goes on from there
        return plan

    def fresh_state(self) -> StagedBuild | ReadyBuild:
        """How a fresh start builds its state: the given initial state placed on the mesh,
        or the Program's state around the model's own arrays."""
        if self.initial_state is not None:
            return self.program.placed_state(self.initial_state)
        return self.program.stage_state(copy=False)

    def start_state(
        self, plan: StartPlan, *, fresh: StagedBuild | ReadyBuild | None = None
    ) -> RunStart:
        """`plan` with its state: a fresh state (built by `fresh`, a `fresh_state()`, when
        given), or the checkpoint restored onto the Program's shardings (its extra arrays, if
        it has any, handed to the source's `resume_extra`)."""
        start = self.files.load(
            plan,
            fresh_state=lambda: (fresh or self.fresh_state()).run(),
            abstract_state=self.program.abstract_state,
            init_optimizer=self.program.optimizer.init,
        )
        path = start.resumed_from
        if path is not None and start.extra is not None and self.source is not None:
            self.source.resume_extra(
                start.extra, lambda abstract: restore_extra(path, abstract), start.step
            )
        return start

    def _model_config(self) -> dict[str, Any] | None:
        return model_config_dict(self.program.model)


def model_config_dict(model: Any) -> dict[str, Any] | None:
    """The model's config as a checkpoint records it (None: a model without one)."""
    config = getattr(model, "config", None)
    return config.to_dict() if hasattr(config, "to_dict") else None


def library_class(trainer_class: type) -> str:
    """The name of the nearest jaxtrain class in `trainer_class`'s MRO, the trainer a
    checkpoint records: a user's subclass of DPOTrainer runs DPOTrainer's task."""
    return next(c.__name__ for c in trainer_class.__mro__ if c.__module__.startswith("jaxtrain."))


def load_program_state(
    program: Any, path: str | Path, *, optimizer: str, trainer_name: str | None = None
) -> TrainState:
    """The TrainState at `path` restored onto `program`'s shardings, once the checkpoint is
    checked to be of this model, `optimizer` and `trainer_name` (a class name, None: not
    checked; no run needed: export, sampling)."""
    return load_checked(
        path,
        program.abstract_state(),
        model_class=type(program.model).__name__,
        model_config=model_config_dict(program.model),
        optimizer=optimizer,
        trainer_name=trainer_name,
    )


def task_fields(arguments: Any) -> tuple[str, ...]:
    """The fields a task's arguments class adds to TrainingArguments (DPO's beta, ...)."""
    from jaxtrain.arguments import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    return tuple(f.name for f in dataclasses.fields(arguments) if f.name not in base)
