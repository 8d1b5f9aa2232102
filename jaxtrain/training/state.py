"""Building the train state on the mesh: staged (traced now, compiled beside the step's
trace, run later) or ready (placed from given arrays). The state type is jaxtrain/state.py."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.state import TrainState  # noqa: F401 - also its old import path


def count_parameters(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


class StagedBuild:
    """A jitted build (no arguments are traced later) in three stages, so that its compile
    can overlap other work: created = traced and lowered now, in the caller's thread (JAX's
    settings contexts are per thread); `compile()` is XLA's part, safe in another thread (it
    releases the GIL); `run()` executes it, compiling first if `compile()` was not called,
    and returns `then(outputs)`. Call `run()` only once `compile()` has returned."""

    def __init__(
        self, jitted: Any, *args: Any, then: Callable[[Any], Any] = lambda outputs: outputs
    ):
        self._lowered = jitted.lower(*args)
        self._args, self._then = args, then
        self._compiled: Any = None

    def compile(self) -> None:
        if self._compiled is None:
            self._compiled = self._lowered.compile()

    def run(self) -> Any:
        self.compile()
        outputs, self._args = self._compiled(*self._args), ()  # donated arrays are not kept
        return self._then(outputs)


class ReadyBuild:
    """A build with nothing to compile, with StagedBuild's interface: `run()` is `make()`
    (a state placed from given arrays, for instance)."""

    def __init__(self, make: Callable[[], Any]):
        self._make = make

    def compile(self) -> None:
        pass

    def run(self) -> Any:
        return self._make()


def stage_state_build(
    new_state: Callable[[Any], TrainState],
    params: Any,
    shardings: TrainState,
    *,
    take: bool,
    keep: Any = None,
    compiler_options: dict[str, Any] | None = None,
) -> StagedBuild:
    """`new_state(params)` on `shardings`, with params already placed there, staged.

    `take=False`: the state gets its own copies (jit would forward unchanged inputs).
    `take=True`: the state is built around `params` themselves: they are donated, so XLA
    aliases them instead of copying, and the arrays passed in are deleted. The few that
    `keep` also holds (a DPO reference cloned from the model) are copied first.
    `compiler_options`: XLA's, for this compile (the Trainer passes the run's).
    """
    jit = functools.partial(
        jax.jit, out_shardings=shardings, compiler_options=compiler_options or None
    )
    if not take:
        return StagedBuild(jit(lambda p: new_state(jax.tree.map(jnp.copy, p))), params)
    kept = set().union(*map(_buffers, jax.tree.leaves(keep)))
    params = jax.tree.map(lambda x: jnp.copy(x) if _buffers(x) & kept else x, params)
    return StagedBuild(jit(new_state, donate_argnums=0), params)


def abstract_arrays(tree: Any, shardings: Any = None) -> Any:
    """`tree` with every array replaced by its shape, dtype (weak or not) and sharding:
    `shardings` (a matching tree) or the array's own (host arrays, such as a model a Ray job
    rebuilt from numpy, have none)."""

    def abstract(x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(
            x.shape,
            x.dtype,
            sharding=sharding if sharding is not None else getattr(x, "sharding", None),
            weak_type=getattr(x, "weak_type", False),
        )

    if shardings is None:
        return jax.tree.map(abstract, tree)
    return jax.tree.map(abstract, tree, shardings)


def _buffers(x: Any) -> set[int]:
    """Addresses of an array's buffers on this process's devices (empty for non-arrays)."""
    if not isinstance(x, jax.Array) or x.is_deleted():
        return set()
    return {shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards}


def param_logical_axes(params: Any) -> Any:
    """The `logical_axes` metadata of each nnx.Param (None where a param has none)."""
    return jax.tree.map(
        lambda v: v.get_metadata().get("logical_axes") if isinstance(v, nnx.Variable) else None,
        params,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
