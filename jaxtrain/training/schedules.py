"""Learning-rate schedules: a shape that compiles, and numbers that need not.

* Steps count optimizer updates (optax's ``count``); the first update is step 0.
* Warmup never wastes an update: step ``s < W`` (W = warmup_steps) uses ``lr * (s + 1) / W``, so
  step 0 gives ``lr / W`` (not 0) and step ``W - 1`` the peak. Decay starts at step W and reaches
  ``min_lr_ratio * lr`` at step ``total_steps``.

A schedule is its kind and whether it warms up (the ``ScheduleShape``, which decides the
program), and a dict of numbers: the peak, the steps, the floor. The train step takes the
numbers as an argument, so one compiled step serves every learning rate, warmup and length (a
sweep, a rerun with another rate). Each formula repeats the operations of the optax schedule it
replaces in the same order, with the same host-side (double precision) arithmetic: their values
are optax's to the bit (tests/training/test_optim.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax.numpy as jnp

from jaxtrain.config.tables import SCHEDULERS

Numbers = dict[str, Any]  # Python numbers on the host, traced scalars inside a step


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def canonical(name: Any, valid: tuple[str, ...], kind: str) -> str:
    key = name.strip().lower().replace("-", "_") if isinstance(name, str) else None
    require(key in valid, f"unknown {kind} {name!r}; valid names: {', '.join(valid)}")
    return key


def _linear(count: Any, span: Any, end: Any, steps: Any) -> Any:
    """optax.linear_schedule from init to `end` over `steps`, `span` = init - end (computed on
    the host in double precision, as optax subtracts its Python floats)."""
    frac = 1 - jnp.clip(count, 0, steps) / steps
    return span * frac + end


def _cosine(count: Any, n: Numbers) -> Any:
    """optax.cosine_decay_schedule(peak, decay_steps, alpha): its operations in its order."""
    count = jnp.minimum(count, n["decay_steps"])
    cosine = 0.5 * (1 + jnp.cos(jnp.pi * count / n["decay_steps"]))
    return n["peak"] * (n["one_minus_alpha"] * cosine**1.0 + n["alpha"])  # optax's exponent


def _wsd(count: Any, n: Numbers) -> Any:
    decay = _linear(count - n["stable_steps"], n["span"], n["floor"], n["decay_steps"])
    return jnp.where(count < n["stable_steps"], n["peak"], decay)


# name -> the rate after warmup, from the step counted from warmup's end
_AFTER_WARMUP: dict[str, Callable[[Any, Numbers], Any]] = {
    "constant": lambda count, n: n["peak"],
    "linear": lambda count, n: _linear(count, n["span"], n["floor"], n["decay_steps"]),
    "cosine": _cosine,
    "warmup_cosine": _cosine,
    "wsd": _wsd,
}


@dataclass(frozen=True)
class ScheduleShape:
    """What a schedule compiles to: its kind and whether it warms up."""

    kind: str
    warmup: bool

    def __call__(self, numbers: Numbers, step: Any) -> Any:
        """The learning rate of update `step` (a host int or a traced one)."""
        main = _AFTER_WARMUP[self.kind]
        if not self.warmup:
            return main(step, numbers)
        # (s + 1) / W ramp: from lr/W at step 0 to lr at step W - 1 (W = 1 is flat at lr).
        ramp = _linear(step, numbers["ramp_span"], numbers["peak"], numbers["ramp_steps"])
        boundary = numbers["warmup_steps"]
        return jnp.where(step < boundary, ramp, main(step - boundary, numbers))


@dataclass(frozen=True, eq=False)  # hashed by identity, as jax.jit(schedule) needs
class Schedule:
    """``step -> learning rate`` (an optax schedule) whose numbers can be swapped: `shape`
    with `numbers` (``with_numbers`` gives the same schedule on traced ones)."""

    shape: ScheduleShape
    numbers: Numbers

    def __call__(self, step: Any) -> Any:
        return self.shape(self.numbers, step)

    def with_numbers(self, numbers: Numbers) -> Schedule:
        return replace(self, numbers=numbers)


def _numbers(key: str, peak: float, total: int, warmup: int, ratio: float, fraction: float):
    floor, decay_steps = peak * ratio, total - warmup
    numbers: Numbers = {"peak": peak}
    if warmup:
        numbers |= {"warmup_steps": warmup, "ramp_steps": max(warmup - 1, 1)}
        numbers["ramp_span"] = peak / warmup - peak
    if key == "linear":
        numbers |= {"span": peak - floor, "floor": floor, "decay_steps": decay_steps}
    elif key in ("cosine", "warmup_cosine"):
        numbers |= {"decay_steps": float(decay_steps), "one_minus_alpha": 1 - ratio}
        numbers["alpha"] = ratio
    elif key == "wsd":
        decay = max(1, round(fraction * total))
        stable = decay_steps - decay
        require(
            stable >= 0,
            f"wsd: warmup_steps ({warmup}) + decay steps ({decay} = wsd_decay_fraction * "
            f"total_steps) exceed total_steps ({total}); lower warmup_steps or the fraction",
        )
        numbers |= {"stable_steps": stable, "span": peak - floor, "floor": floor}
        numbers["decay_steps"] = decay
    return numbers


def build_schedule(
    name: str,
    *,
    learning_rate: float,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.0,
    wsd_decay_fraction: float = 0.1,
) -> Schedule:
    """Return ``step -> learning rate`` for one of ``SCHEDULERS`` (see the module docstring)."""
    key = canonical(name, SCHEDULERS, "scheduler")
    ok_total = isinstance(total_steps, int) and total_steps > 0
    require(ok_total, f"total_steps must be an int > 0 (optimizer updates), got {total_steps!r}")
    ok_warmup = isinstance(warmup_steps, int) and warmup_steps >= 0
    require(ok_warmup, f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    ok_lr = math.isfinite(learning_rate) and learning_rate >= 0
    require(ok_lr, f"learning_rate must be a finite number >= 0, got {learning_rate!r}")
    require(0 <= min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    ok_fraction = 0 < wsd_decay_fraction <= 1
    require(ok_fraction, f"wsd_decay_fraction must be in (0, 1], got {wsd_decay_fraction}")
    require(
        key != "warmup_cosine" or warmup_steps > 0,
        "warmup_cosine needs warmup_steps > 0; set warmup_steps or use 'cosine'",
    )
    require(
        key == "constant" or warmup_steps < total_steps,
        f"{key}: warmup_steps ({warmup_steps}) must be < total_steps ({total_steps}) to leave "
        "steps to decay; lower warmup_steps or raise total_steps",
    )
    numbers = _numbers(
        key, float(learning_rate), total_steps, warmup_steps, min_lr_ratio, wsd_decay_fraction
    )
    return Schedule(ScheduleShape(key, warmup_steps > 0), numbers)


def learning_rate_at(schedule: Any, step: int) -> float:
    """The learning rate used by update ``step`` (for logging)."""
    return float(schedule(step)) if callable(schedule) else float(schedule)
