"""The train state: a plain pytree of arrays that the jitted step consumes and returns."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class TrainState:
    """Everything that changes from one optimizer update to the next.

    `params` is the nnx.State of the model's nnx.Param variables; the rest of the model
    (graph definition, non-trainable state) lives with the Trainer. No RNG key is stored:
    per-step keys are derived from the seed and `step`, so a resumed run draws the same
    numbers as an uninterrupted one.
    """

    step: jax.Array
    params: Any
    opt_state: Any

    @classmethod
    def create(cls, params: Any, optimizer: Any) -> TrainState:
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def count_parameters(params: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))
