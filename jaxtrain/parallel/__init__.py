"""Parallelism: device mesh, sharding rules, sharded init, per-host batches, multi-host."""

from jaxtrain.config.tables import DISTRIBUTED_MODES
from jaxtrain.parallel.batch import BatchLayout
from jaxtrain.parallel.distributed import (
    DistributedError,
    detect_cluster,
    initialize_distributed,
)
from jaxtrain.parallel.init import ModelFactory
from jaxtrain.parallel.mesh import MESH_AXES, MeshError, build_mesh, resolve_axis_dims
from jaxtrain.parallel.plan import ShardingPlan
from jaxtrain.parallel.rules import DEFAULT_RULES, ShardingRuleError, ShardingRules
from jaxtrain.pytrees import path_str

__all__ = [
    "DEFAULT_RULES",
    "DISTRIBUTED_MODES",
    "MESH_AXES",
    "BatchLayout",
    "DistributedError",
    "MeshError",
    "ModelFactory",
    "ShardingPlan",
    "ShardingRuleError",
    "ShardingRules",
    "build_mesh",
    "detect_cluster",
    "initialize_distributed",
    "path_str",
    "resolve_axis_dims",
]
