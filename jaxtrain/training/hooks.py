"""Hooks: the points of the loop where a Trainer subclass or a callback can act.

The Trainer is itself a TrainerCallback, so a subclass overrides the methods directly;
any object with some of these methods can be passed in `callbacks=[...]` or to
`trainer.add_hook(...)`, and so can a plain function (it is called as `on_step_end`).
Hooks run on the host, outside jit. `on_step_end` receives the step's metrics as device
arrays that are not read yet: reading them (float(...)) makes the host wait for the device,
so only do it when you need to. A hook can end training early by setting
`trainer.should_stop = True`. Return values are ignored: a hook observes the run, it
cannot replace the state or the batch.

Cadence: a hook with `every=N` (`add_hook(hook, every=N)`, or an `every` attribute on the
callback) sees the per-step hooks (`on_step_start`, `on_step_end`) only at steps whose
number, the `step` argument it receives, is a multiple of N; a receiver with a `due(step)`
method decides for itself (the run's own evaluation and saving are such hooks, run_hooks.py).
The other five hooks fire when their event happens (a log, an evaluation, a save: each has
its own cadence in TrainingArguments).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from jaxtrain.errors import ArgumentError

HOOK_NAMES = (
    "on_train_start",
    "on_step_start",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_train_end",
)
# The hooks a cadence applies to; the others are events with cadences of their own.
PER_STEP_HOOKS = ("on_step_start", "on_step_end")


class TrainerCallback:
    def on_train_start(self, trainer: Any, state: Any) -> None: ...

    def on_step_start(self, trainer: Any, state: Any, step: int) -> None: ...

    def on_step_end(self, trainer: Any, state: Any, metrics: dict[str, Any], step: int) -> None: ...

    def on_log(self, trainer: Any, logs: dict[str, float], step: int) -> None: ...

    def on_evaluate(self, trainer: Any, metrics: dict[str, float], step: int) -> None: ...

    def on_save(self, trainer: Any, checkpoint_path: str, step: int) -> None: ...

    def on_train_end(self, trainer: Any, output: Any) -> None: ...


@dataclass(frozen=True)
class Cadence:
    """Due at steps that are multiples of `every`; never when `every` is None."""

    every: int | None = None

    def __post_init__(self) -> None:
        if self.every is not None and (
            isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1
        ):
            raise ArgumentError(f"every={self.every!r}: a cadence is a positive number of steps.")

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0


class ScheduledHook:
    """A callback or function registered with a cadence (`Trainer.add_hook`)."""

    def __init__(self, hook: Any, every: int | None = None) -> None:
        if not callable(hook) and not any(hasattr(hook, name) for name in HOOK_NAMES):
            raise ArgumentError(
                f"add_hook({hook!r}): pass a function (called as on_step_end(trainer, state, "
                f"metrics, step)) or an object with any of {', '.join(HOOK_NAMES)}."
            )
        self.hook, self.every = hook, Cadence(every).every
        if not any(hasattr(hook, name) for name in HOOK_NAMES):
            self.on_step_end = hook  # a plain function is an on_step_end hook

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set on self: the wrapped callback's hooks.
        if name in HOOK_NAMES:
            return getattr(self.hook, name)
        raise AttributeError(name)


class HookSet:
    """The receivers of one run's hooks, in order, each with its cadence."""

    def __init__(self, receivers: Iterable[Any]) -> None:
        self.receivers = [(r, Cadence(getattr(r, "every", None))) for r in receivers]

    def call(self, name: str, *args: Any) -> None:
        """Call hook `name` on every receiver that defines it, in order. For the per-step
        hooks (whose last argument is the step) a receiver with a cadence runs only when due."""
        step = args[-1] if name in PER_STEP_HOOKS else None
        for receiver, cadence in self.receivers:
            if step is not None and not self._due(receiver, cadence, step):
                continue
            method = getattr(receiver, name, None)
            if method is not None:
                method(*args)

    def any_due(self, step: int) -> bool:
        """Whether any receiver's per-step hooks run at `step`."""
        return any(self._due(receiver, cadence, step) for receiver, cadence in self.receivers)

    @staticmethod
    def _due(receiver: Any, cadence: Cadence, step: int) -> bool:
        # A receiver's own `due(step)` (the run's evaluation and saving) or its `every`.
        due = getattr(receiver, "due", None)
        if callable(due):
            return due(step)
        return cadence.every is None or cadence.due(step)


def call_hooks(receivers: list[Any], name: str, *args: Any) -> None:
    """Call hook `name` on every receiver that defines it, in order (no cadence)."""
    HookSet(receivers).call(name, *args)
