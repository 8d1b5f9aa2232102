"""Activation sharding constraints inside the model.

Models call `constrain(x, ("batch", "length", "embed"))` at a few points (the residual
stream, the logits). Outside a sharded trace it is the identity; the Trainer traces its
steps inside `activation_sharding(rules)` so the constraint becomes
`jax.lax.with_sharding_constraint` with the spec the rules give (batch over dp/fsdp, length
over sp, vocab/heads over tp). That keeps XLA from replicating activations.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

_RULES: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "jaxtrain_activation_rules", default=None
)


@contextlib.contextmanager
def activation_sharding(rules: Any) -> Iterator[None]:
    """Within this block, `constrain` uses `rules` (a jaxtrain.parallel.ShardingRules)."""
    token = _RULES.set(rules)
    try:
        yield
    finally:
        _RULES.reset(token)


def with_activation_sharding(fn: Callable[..., Any], rules: Any) -> Callable[..., Any]:
    """`fn` traced with `activation_sharding(rules)` active (wrap a loss function with it)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with activation_sharding(rules):
            return fn(*args, **kwargs)

    return wrapped


def current_rules() -> Any:
    """The rules of the enclosing `activation_sharding` block, or None outside one."""
    return _RULES.get()


def step_device() -> Any:
    """A device of the mesh the step is traced for (the enclosing rules'), else JAX's first
    device: what a kernel's default is chosen for. A plan compiled for TPU or GPU devices
    from a CPU host thus picks the target's kernels, not the host's."""
    rules = _RULES.get()
    return rules.mesh.devices.flat[0] if rules is not None else jax.devices()[0]


def step_platform() -> tuple[str, float | None]:
    """(platform, NVIDIA compute capability or None) of `step_device()`: what the kernels'
    defaults are chosen by."""
    device = step_device()
    capability = getattr(device, "compute_capability", None)
    try:
        return device.platform, float(capability) if capability else None
    except ValueError:  # not a CUDA version: an AMD GPU names its architecture ("gfx90a")
        return device.platform, None


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    rules = _RULES.get()
    if rules is None:
        return x
    spec = rules.activation_spec(x.shape, names)
    return jax.lax.with_sharding_constraint(x, NamedSharding(rules.mesh, spec))
