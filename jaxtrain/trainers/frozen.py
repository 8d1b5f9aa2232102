"""Frozen weights: read by the model, never trained, never in the optimizer state.

The Trainer splits a model into its `nnx.Param` variables (trained, in the TrainState) and
the rest; `Frozen` is a Variable type that is not a Param, so frozen weights (a DPO reference,
a distillation teacher, LoRA's base kernels) land in the rest. The train and eval steps take
the rest as a sharded argument (Trainer.frozen_state), never as a constant baked into the
compiled program. Frozen variables keep their `logical_axes`, so the sharding rules place
them exactly like the parameters they were.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from jaxtrain.models.frozen import Frozen, freeze, unfreeze

__all__ = ["Frozen", "TaskModel", "freeze", "unfreeze"]


class TaskModel(nnx.Module):
    """The trained model beside frozen models a task reads (a reference, a teacher).

    `model` keeps its Params (trained); every module in `frozen` is frozen first. The Trainer
    sees one module; `config` and `remat_policy` are the trained model's, so throughput, the
    model card and gradient_checkpointing apply to it (the frozen models follow its remat
    policy too).
    """

    def __init__(self, model: nnx.Module, **frozen: nnx.Module | None):
        self.model = model
        self.config = getattr(model, "config", None)
        self.frozen_names = tuple(frozen)
        for name, sub in frozen.items():
            setattr(self, name, freeze(sub) if sub is not None else None)

    @property
    def remat_policy(self) -> Any:
        return self.model.remat_policy  # AttributeError when the model has none

    @remat_policy.setter
    def remat_policy(self, policy: Any) -> None:
        for module in (self.model, *(getattr(self, n) for n in self.frozen_names)):
            if module is not None and hasattr(module, "remat_policy"):
                module.remat_policy = policy
