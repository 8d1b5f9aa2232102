"""ShardingPlan: everything the Trainer needs to place state and batches on the mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.config.sections import RuntimeSettings
from jaxtrain.errors import MeshError
from jaxtrain.parallel.batch import BatchLayout
from jaxtrain.parallel.mesh import build_mesh
from jaxtrain.parallel.rules import ShardingRules
from jaxtrain.parallel.zero import optimizer_shardings

if TYPE_CHECKING:
    from jaxtrain.arguments import TrainingArguments
    from jaxtrain.state import TrainState


class ShardingPlan:
    """Mesh + parameter rules + batch layout.

    `sharding_for(path, shape, logical_axes)` answers for one parameter (e.g. a weight loader
    placing each tensor as it reads it); `state_shardings(abstract_state)` for a TrainState.
    """

    def __init__(self, mesh: Mesh, rules: ShardingRules | None = None):
        self.mesh = mesh
        self.rules = rules if rules is not None else ShardingRules(mesh)
        self.batch = BatchLayout(mesh)
        self.replicated = NamedSharding(mesh, P())

    @classmethod
    def from_settings(
        cls, settings: RuntimeSettings, devices: Sequence[jax.Device] | None = None
    ) -> ShardingPlan:
        mesh = build_mesh(settings.sharding_axis_dims, devices)
        rules = ShardingRules(mesh, settings.sharding_rules, settings.sharding_regex_rules)
        return cls(mesh, rules)

    @classmethod
    def from_arguments(
        cls, args: TrainingArguments, devices: Sequence[jax.Device] | None = None
    ) -> ShardingPlan:
        return cls.from_settings(RuntimeSettings.from_arguments(args), devices)

    def sharding_for(
        self, path: str, shape: Sequence[int], logical_axes: Sequence[str | None] | None
    ) -> NamedSharding:
        return self.rules.sharding_for(path, shape, logical_axes)

    def param_shardings(self, params: Any) -> Any:
        return self.rules.tree_shardings(params)

    def check_expert_axis(self, params: Any) -> None:
        """MeshError when ep > 1 but no parameter is split over ep: every ep group would then
        hold the whole model and do the same work (the batch is not split over ep either)."""
        ep = self.mesh.shape["ep"]
        if ep == 1:
            return
        specs = jax.tree.leaves(
            self.param_shardings(params), is_leaf=lambda x: isinstance(x, NamedSharding)
        )
        for sharding in specs:
            for entry in sharding.spec:
                if entry == "ep" or (isinstance(entry, tuple) and "ep" in entry):
                    return
        dims = list(self.mesh.shape.values())
        fixed = dims.copy()
        fixed[1], fixed[2] = dims[1] * ep, 1
        raise MeshError(
            f"sharding_axis_dims={tuple(dims)} sets ep={ep}, but no parameter of this model "
            "has an expert axis (logical axis 'expert' or a rule naming 'ep'), so each ep "
            "group would repeat the same work. Fold ep into fsdp or dp, e.g. "
            f"--sharding_axis_dims {','.join(map(str, fixed))}."
        )

    def train_step_jit_options(self, state_shardings: Any, batch: dict[str, Any]) -> dict:
        """`jax.jit` options of the train step: state and batch placed on the mesh, the state
        donated, metrics replicated."""
        batch_shardings = self.batch.shardings(batch, micro_axis=True)
        return {
            "in_shardings": (state_shardings, batch_shardings),
            "out_shardings": (state_shardings, self.replicated),
            "donate_argnums": 0,
        }

    def state_shardings(self, abstract_state: TrainState) -> TrainState:
        params = self.param_shardings(abstract_state.params)
        opt = optimizer_shardings(
            abstract_state.opt_state, abstract_state.params, params, self.mesh
        )
        return abstract_state.replace(step=self.replicated, params=params, opt_state=opt)
