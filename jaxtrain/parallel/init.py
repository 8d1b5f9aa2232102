"""Sharded initialisation: the model is born sharded, no host holds the full parameters.

`ModelFactory(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))` is traced abstractly
(`nnx.eval_shape`) to learn every variable's shape and logical axes; the rules turn those into
shardings, and `jax.jit(init, out_shardings=...)` then runs the initialisers so that each
device computes only its own shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxtrain.parallel.plan import ShardingPlan


class ModelFactory:
    """A zero-argument function building the model; pass it to Trainer(model=...)."""

    def __init__(self, build: Callable[[], nnx.Module]):
        if not callable(build):
            raise TypeError(
                f"ModelFactory needs a zero-argument callable returning an nnx.Module, got {build!r}."
            )
        self.build = build

    def abstract(self) -> nnx.Module:
        """The model with jax.ShapeDtypeStruct in place of arrays (nothing allocated)."""
        return nnx.eval_shape(self.build)

    def shardings(self, plan: ShardingPlan) -> tuple[nnx.GraphDef, Any, Any]:
        """(graphdef, abstract state, shardings of the whole state) of the model."""
        graphdef, state = nnx.split(self.abstract())
        return graphdef, state, plan.param_shardings(state)

    def init_function(self, plan: ShardingPlan) -> Callable[[], Any]:
        """The jitted init returning the model state, each leaf already sharded."""
        _, _, shardings = self.shardings(plan)
        return jax.jit(lambda: nnx.split(self.build())[1], out_shardings=shardings)

    def create(self, plan: ShardingPlan) -> nnx.Module:
        graphdef, _, _ = self.shardings(plan)
        state = self.init_function(plan)()
        return nnx.merge(graphdef, state)
