"""Evaluation and saving: the run's own hooks, each owning its cadence.

They receive `on_step_end` like users' hooks (HookSet), after the step's logging window has
closed; each says when it is `due`. The loop calls them only when one is due, after it has
written the pending logs and checked for an unseen NaN (nothing is evaluated or saved past
one), evaluation before saving so a checkpoint records that its step was evaluated. After
the last step `finish` runs what the cadences left out (the final evaluation, the final or
the stop's save).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jaxtrain.training.hooks import Cadence, TrainerCallback
from jaxtrain.training.run_parts import RunParts


class StopState:
    """Why the loop is about to leave after this step, and whether an interval save is due:
    what the stop polls agreed on, read by the hooks' `due`."""

    def __init__(self) -> None:
        self.reason: str | None = None  # "signal:SIGTERM", "time_limit", None
        self.interval_save_due = False


class EvaluationHook(TrainerCallback):
    """Every `every` steps (eval_steps, or one epoch) and at the run's last step; a run that
    is stopping (signal, time limit) saves without evaluating."""

    def __init__(
        self,
        evaluate: Any,
        every: int | None,
        last_step: int,
        stop: StopState,
        *,
        enabled: bool,
        evaluated_step: int = -1,
    ):
        self.evaluate, self.cadence, self.last_step = evaluate, Cadence(every), last_step
        self.stop, self.enabled = stop, enabled
        self.evaluated_step = evaluated_step  # the newest step evaluated (or -1)

    def due(self, step: int) -> bool:
        if not self.enabled or self.stop.reason is not None:
            return False
        return self.cadence.due(step) or step == self.last_step

    def on_step_end(self, trainer: RunParts, state: Any, metrics: Any, step: int) -> None:
        self.evaluate(state, step)
        self.evaluated_step = step

    def finish(self, state: Any, step: int, *, finished: bool) -> None:
        """A run that finished (or a hook stopped) is evaluated at its last step once."""
        if finished and self.enabled and self.evaluated_step != step:
            self.on_step_end(None, state, None, step)


class SaveHook(TrainerCallback):
    """Every `every` steps (save_steps), when save_interval_minutes have passed, and at once
    when the run is stopping; at the end, the final save (save_final) or the stop's."""

    def __init__(
        self,
        save: Callable[..., str],
        every: int | None,
        stop: StopState,
        evaluation: EvaluationHook,
        *,
        saved_step: int = -1,
    ):
        """`save(state, evaluated=...)` starts a checkpoint and returns its directory."""
        self.save, self.cadence, self.stop, self.evaluation = (
            save,
            Cadence(every),
            stop,
            evaluation,
        )
        self.saved_step = saved_step  # the newest step saved (or -1)
        self.last_save_time = time.monotonic()
        self.checkpoint_path: str | None = None

    def due(self, step: int) -> bool:
        stopping = self.stop.reason is not None
        return self.cadence.due(step) or self.stop.interval_save_due or stopping

    def on_step_end(self, trainer: Any, state: Any, metrics: Any, step: int) -> None:
        evaluated = self.evaluation.evaluated_step == step
        self.checkpoint_path = self.save(state, evaluated=evaluated)
        self.saved_step, self.last_save_time = step, time.monotonic()

    def finish(self, state: Any, step: int, *, finished: bool, save_final: bool) -> None:
        if (save_final or not finished) and self.saved_step != step:
            self.on_step_end(None, state, None, step)
