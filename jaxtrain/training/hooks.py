"""Hooks: the points of the loop where a Trainer subclass or a callback can act.

The Trainer is itself a TrainerCallback, so a subclass overrides the methods directly;
any object with some of these methods can be passed in `callbacks=[...]` or to
`trainer.add_hook(...)`, and so can a plain function (it is called as `on_step_end`).
Hooks run on the host, outside jit. `on_step_end` receives the step's metrics as device
arrays that are not read yet: reading them (float(...)) makes the host wait for the device,
so only do it when you need to. A hook can end training early by setting
`trainer.should_stop = True`.

Three hooks may change what the loop works with (the seeds' on_step_start, on_step_end and
_preprocess_batch_input); returning None leaves everything as it was:
- `on_step_start(trainer, state, step)` may return a new state: the step runs from it;
- `on_batch(trainer, batch, step)` may return a new batch, or `(batch, extra_logs)`: the step
  consumes that batch (the global one, on the mesh), and `extra_logs` (plain numbers) are
  logged with the logs of the window that step belongs to (the last value of each key);
- `on_step_end(trainer, state, metrics, step)` may return `(state, metrics)`: the loop goes
  on from that state, and logs those metrics (keys follow the objective's rule, objective.py:
  an added key is a sum, logged per target token).
With several receivers, each gets what the one before it returned.

What a returned state costs. It must have the state's structure, shapes, dtypes and
shardings (else ArgumentError naming the hook): the step is compiled ahead of time for
exactly those, and a state that differs would recompile it, or fail inside it. Operations in
a hook run op by op outside the compiled step; reading a value (float(x), np.asarray(x),
device_get) makes the host wait for the step in flight, so the device idles while the hook
and the next dispatch run, and the one-step-late metrics read no longer hides the host's
time. Arrays built on the host (numpy) must be placed first:
`jax.device_put(x, trainer.program.state_shardings...)`. A batch of another shape recompiles the step
(logged, with a warning naming the changed shapes). When no hook returns anything the loop
does none of this: the device never waits for the host.

Cadence: a hook with `every=N` (`add_hook(hook, every=N)`, or an `every` attribute on the
callback) sees the per-step hooks (`on_step_start`, `on_batch`, `on_step_end`) only at steps
whose number, the `step` argument it receives, is a multiple of N (`on_step_start` and
`on_batch` receive the number of steps done before this one); a receiver with a `due(step)`
method decides for itself (the run's own evaluation and saving are such hooks,
run_hooks.py). The other hooks fire when their event happens (a log, the start of an
evaluation, its end, a save: each has its own cadence in TrainingArguments).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jax

from jaxtrain.errors import ArgumentError
from jaxtrain.objective import RESERVED_LOG_NAMES

HOOK_NAMES = (
    "on_train_start",
    "on_step_start",
    "on_batch",
    "on_step_end",
    "on_log",
    "on_evaluate_start",
    "on_evaluate",
    "on_save",
    "on_train_end",
)
# The hooks a cadence applies to; the others are events with cadences of their own.
PER_STEP_HOOKS = ("on_step_start", "on_batch", "on_step_end")


class TrainerCallback:
    def on_train_start(self, trainer: Any, state: Any) -> None: ...

    def on_step_start(self, trainer: Any, state: Any, step: int) -> Any:
        """None, or the state the step runs from (same shapes, dtypes, shardings)."""

    def on_batch(self, trainer: Any, batch: dict[str, Any], step: int) -> Any:
        """None, a batch, or (batch, extra_logs): what the step consumes and logs."""

    def on_step_end(self, trainer: Any, state: Any, metrics: dict[str, Any], step: int) -> Any:
        """None, or (state, metrics): what the loop continues from and logs."""

    def on_log(self, trainer: Any, logs: dict[str, float], step: int) -> None: ...

    def on_evaluate_start(self, trainer: Any, state: Any, step: int) -> None: ...

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
        hooks (whose last argument is the step) a receiver with a cadence runs only when due.
        What they return is not looked at: the loop's own receivers use this."""
        step = args[-1] if name in PER_STEP_HOOKS else None
        for _, method in self._methods(name, step):
            method(*args)

    def step_start(self, trainer: Any, state: Any, step: int) -> Any:
        """`on_step_start` on every receiver due; returns the state the step runs from."""
        for receiver, method in self._methods("on_step_start", step):
            new = method(trainer, state, step)
            if new is not None:
                check_state_like(state, new, hook_name(receiver, "on_step_start"))
                state = new
        return state

    def batch(self, trainer: Any, batch: Any, step: int) -> tuple[Any, dict[str, Any]]:
        """`on_batch` on every receiver due; returns (the batch to step on, extra logs)."""
        extra: dict[str, Any] = {}
        for receiver, method in self._methods("on_batch", step):
            out = method(trainer, batch, step)
            if out is None:
                continue
            if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
                out, logs = out
                taken = sorted(set(logs) & RESERVED_LOG_NAMES)
                if taken:
                    raise ArgumentError(
                        f"{hook_name(receiver, 'on_batch')} returned extra logs named "
                        f"{', '.join(taken)}: the loop logs those names itself; rename them."
                    )
                extra.update(logs)
            if not isinstance(out, Mapping):
                raise ArgumentError(
                    f"{hook_name(receiver, 'on_batch')} returned {type(out).__name__}: return "
                    "None, the batch (a dict of arrays), or (batch, extra_logs)."
                )
            batch = out
        return batch, extra

    def step_end(self, trainer: Any, state: Any, metrics: Any, step: int) -> tuple[Any, Any]:
        """`on_step_end` on every receiver due; returns the (state, metrics) to go on with."""
        for receiver, method in self._methods("on_step_end", step):
            out = method(trainer, state, metrics, step)
            if out is None:
                continue
            where = hook_name(receiver, "on_step_end")
            if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
                raise ArgumentError(
                    f"{where} returned {type(out).__name__}: return None or (state, metrics)."
                )
            new_state, new_metrics = out
            missing = sorted(set(metrics) - set(new_metrics))
            if missing:  # the log reads them (objective.py)
                raise ArgumentError(
                    f"{where} returned metrics without {', '.join(missing)}: keep the step's "
                    "keys (change values or add keys: {**metrics, ...})."
                )
            check_state_like(state, new_state, where)
            state, metrics = new_state, dict(new_metrics)
        return state, metrics

    def any_due(self, step: int) -> bool:
        """Whether any receiver's per-step hooks run at `step`."""
        return any(self._due(receiver, cadence, step) for receiver, cadence in self.receivers)

    def _methods(self, name: str, step: int | None) -> Iterable[tuple[Any, Any]]:
        """(receiver, its hook `name`) in order, for receivers that define it and are due."""
        for receiver, cadence in self.receivers:
            if step is not None and not self._due(receiver, cadence, step):
                continue
            method = getattr(receiver, name, None)
            if method is not None:
                yield receiver, method

    @staticmethod
    def _due(receiver: Any, cadence: Cadence, step: int) -> bool:
        # A receiver's own `due(step)` (the run's evaluation and saving) or its `every`.
        due = getattr(receiver, "due", None)
        if callable(due):
            return due(step)
        return cadence.every is None or cadence.due(step)


def hook_name(receiver: Any, name: str) -> str:
    """'MyCallback.on_step_end' (or the function's name) for error messages."""
    hook = receiver.hook if isinstance(receiver, ScheduledHook) else receiver
    if not any(hasattr(hook, n) for n in HOOK_NAMES):  # a plain function
        return f"hook {getattr(hook, '__qualname__', repr(hook))} ({name})"
    return f"{type(hook).__name__}.{name}"


def check_state_like(old: Any, new: Any, where: str) -> None:
    """ArgumentError naming `where` unless `new` has `old`'s structure, and each leaf its
    shape, dtype, weak type and sharding: the compiled step accepts nothing else (a mismatch
    would recompile it or fail inside it). Reads only metadata: the device is not waited for."""
    if jax.tree.structure(old) != jax.tree.structure(new):
        raise ArgumentError(
            f"{where} returned a state of another structure than the train state's. Return "
            "state.replace(...) with arrays like the ones it replaces, or None."
        )
    fix = "; place it with jax.device_put(x, old.sharding) and keep its shape and dtype."
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(old), jax.tree.leaves(new), strict=True
    ):
        name = jax.tree_util.keystr(path)
        if not isinstance(b, jax.Array):
            raise ArgumentError(
                f"{where} returned a state whose {name} is a {type(b).__name__}, not a "
                f"jax.Array{fix}"
            )
        if (a.shape, a.dtype, a.weak_type) != (b.shape, b.dtype, b.weak_type):
            raise ArgumentError(
                f"{where} returned a state whose {name} is {b.dtype}{list(b.shape)}"
                f"{' (weak)' if b.weak_type else ''}, not {a.dtype}{list(a.shape)}"
                f"{' (weak)' if a.weak_type else ''}: the step is compiled for the latter{fix}"
            )
        if not b.sharding.is_equivalent_to(a.sharding, a.ndim):
            raise ArgumentError(
                f"{where} returned a state whose {name} is placed as {b.sharding}, not "
                f"{a.sharding}{fix}"
            )


def call_hooks(receivers: list[Any], name: str, *args: Any) -> None:
    """Call hook `name` on every receiver that defines it, in order (no cadence)."""
    HookSet(receivers).call(name, *args)
