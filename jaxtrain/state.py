"""The train state: a plain pytree of arrays that the jitted step consumes and returns.

It sits below training/ (checkpoints save it, the sharding plan places it, the steps update
it); how a fresh one is built on the mesh is training/state.py's business.
"""

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
