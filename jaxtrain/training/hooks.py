"""Hooks: the points of the loop where a Trainer subclass or a callback can act.

The Trainer is itself a TrainerCallback, so a subclass overrides the methods directly;
any object with some of these methods can be passed in `callbacks=[...]`. Hooks run on the
host, outside jit. `on_step_end` receives the step's metrics as device arrays that are not
read yet: reading them (float(...)) makes the host wait for the device, so only do it when
you need to. A hook can end training early by setting `trainer.should_stop = True`.
"""

from __future__ import annotations

from typing import Any

HOOK_NAMES = (
    "on_train_start",
    "on_step_start",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_train_end",
)


class TrainerCallback:
    def on_train_start(self, trainer: Any, state: Any) -> None: ...

    def on_step_start(self, trainer: Any, state: Any, step: int) -> None: ...

    def on_step_end(self, trainer: Any, state: Any, metrics: dict[str, Any], step: int) -> None: ...

    def on_log(self, trainer: Any, logs: dict[str, float], step: int) -> None: ...

    def on_evaluate(self, trainer: Any, metrics: dict[str, float], step: int) -> None: ...

    def on_save(self, trainer: Any, checkpoint_path: str, step: int) -> None: ...

    def on_train_end(self, trainer: Any, output: Any) -> None: ...


def call_hooks(receivers: list[Any], name: str, *args: Any) -> None:
    """Call hook `name` on every receiver that defines it, in order."""
    for receiver in receivers:
        method = getattr(receiver, name, None)
        if method is not None:
            method(*args)
