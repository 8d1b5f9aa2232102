"""Logical-axis rules: which mesh axes shard which dimension of a parameter or activation.

Parameters carry logical names per dimension (`nnx.Param(..., logical_axes=("embed", "mlp"))`).
A parameter's PartitionSpec is decided in this order:

1. the first `regex_rules` entry whose pattern matches the parameter path ("model/layers/0/
   mlp/down_proj/kernel") gives the spec directly (one entry per dim) -- for custom models;
2. otherwise each dimension's logical name is looked up in the rule table (DEFAULT_RULES
   updated with the user's `rules`): tp shards heads/kv_heads/mlp/vocab, ep the experts;
3. then, unless fsdp is already used, fsdp shards the largest dimension that is still
   unsharded and divisible (dp never shards parameters: it replicates them).

An explicit rule (table or regex) that does not divide its dimension is an error naming the
parameter, its shape and the mesh axes: never a silent fallback to replication. Mesh axes
of size 1 are dropped from specs, so a single-device mesh gives fully replicated specs.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtrain.errors import ShardingRuleError
from jaxtrain.parallel.mesh import MESH_AXES

AxisRule = str | tuple[str, ...] | None

# Parameter dimensions. Names absent here (and None) are left to the fsdp placement.
DEFAULT_RULES: dict[str, AxisRule] = {
    "vocab": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "expert": "ep",
    "embed": None,
    "head_dim": None,
    "qkv": None,
    "gate_up": None,
}

# Activation dimensions (inside the model): a hint to XLA, so a rule that does not divide
# a dimension is skipped instead of raising.
ACTIVATION_RULES: dict[str, AxisRule] = {
    "batch": ("dp", "fsdp"),
    "length": "sp",
    "vocab": "tp",
    "heads": "tp",
    "kv_heads": "tp",
    "mlp": "tp",
    "expert": "ep",
    "embed": None,
}


def path_str(path: Sequence[Any]) -> str:
    """'model/layers/0/mlp/down_proj/kernel' for a pytree key path (a trailing .value dropped)."""
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if names and names[-1] == "value":
        names = names[:-1]
    return "/".join(names)


def _as_axes(rule: Any, where: str) -> tuple[str, ...]:
    if rule is None:
        return ()
    axes = (rule,) if isinstance(rule, str) else tuple(rule)
    for axis in axes:
        if axis not in MESH_AXES:
            raise ShardingRuleError(
                f"{where}: {axis!r} is not a mesh axis; use one of {MESH_AXES} (or null)."
            )
    return axes


class ShardingRules:
    """Turns (path, shape, logical axes) into a PartitionSpec / NamedSharding on `mesh`."""

    def __init__(
        self,
        mesh: Mesh,
        rules: Mapping[str, AxisRule] | None = None,
        regex_rules: Sequence[tuple[str, Sequence[AxisRule]]] | None = None,
        *,
        auto_fsdp: bool = True,
    ):
        self.mesh = mesh
        self.auto_fsdp = auto_fsdp
        table = dict(DEFAULT_RULES)
        table.update(rules or {})
        self.rules = {
            name: _as_axes(rule, f"sharding_rules[{name!r}]") for name, rule in table.items()
        }
        self.regex_rules = []
        for i, entry in enumerate(regex_rules or []):
            if not (isinstance(entry, Sequence) and len(entry) == 2):
                raise ShardingRuleError(
                    f"sharding_regex_rules[{i}]={entry!r} must be [pattern, [axis per dim]], "
                    'e.g. ["mlp/.*/kernel$", [null, "tp"]].'
                )
            pattern, spec = entry
            try:
                compiled = re.compile(pattern)
            except re.error as err:
                raise ShardingRuleError(
                    f"sharding_regex_rules[{i}]: pattern {pattern!r} is not a valid regex: {err}"
                ) from None
            dims = [_as_axes(a, f"sharding_regex_rules[{i}] ({pattern!r})") for a in spec]
            self.regex_rules.append((compiled, dims))

    def _size(self, axes: Sequence[str]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def _live(self, axes: Sequence[str]) -> tuple[str, ...]:
        return tuple(a for a in axes if self.mesh.shape[a] > 1)

    def spec_for(
        self, path: str, shape: Sequence[int], logical_axes: Sequence[str | None] | None
    ) -> P:
        """The PartitionSpec of one parameter; raises ShardingRuleError when a rule misfits."""
        shape = tuple(int(s) for s in shape)
        dims: list[tuple[str, ...]] | None = None
        source = ""
        for pattern, spec in self.regex_rules:
            if pattern.search(path):
                if len(spec) != len(shape):
                    raise ShardingRuleError(
                        f"sharding_regex_rules {pattern.pattern!r} gives {len(spec)} entries for "
                        f"parameter {path!r} of shape {shape} ({len(shape)} dims). Give one "
                        "entry (mesh axis, list of axes or null) per dimension."
                    )
                dims, source = [self._live(a) for a in spec], f"regex {pattern.pattern!r}"
                break
        if dims is None:
            names = list(logical_axes) if logical_axes is not None else [None] * len(shape)
            if len(names) != len(shape):
                raise ShardingRuleError(
                    f"parameter {path!r} of shape {shape} has logical_axes={tuple(names)} "
                    f"({len(names)} names for {len(shape)} dims); give one name per dim."
                )
            dims = [self._live(self.rules.get(n, ())) if n else () for n in names]
            source = "sharding rules"
        used = [a for axes in dims for a in axes]
        if len(used) != len(set(used)):
            raise ShardingRuleError(
                f"parameter {path!r} of shape {shape}: the {source} use a mesh axis twice "
                f"({dims}); each mesh axis may shard only one dimension."
            )
        for i, (size, axes) in enumerate(zip(shape, dims, strict=True)):
            if axes and size % self._size(axes):
                name = logical_axes[i] if logical_axes else None
                raise ShardingRuleError(
                    f"parameter {path!r} of shape {shape}: dimension {i} (size {size}, logical "
                    f"axis {name!r}) cannot be split over mesh axes {axes} of total size "
                    f"{self._size(axes)} ({source}, mesh {dict(self.mesh.shape)}). Change "
                    "sharding_axis_dims or the rule (sharding_rules / sharding_regex_rules) "
                    "for this axis."
                )
        fsdp = self.mesh.shape["fsdp"]
        if self.auto_fsdp and fsdp > 1 and "fsdp" not in used:
            candidates = [
                (shape[i], -i) for i in range(len(shape)) if not dims[i] and shape[i] % fsdp == 0
            ]
            if candidates:
                i = -max(candidates)[1]
                dims[i] = ("fsdp",)
        return P(*[(a[0] if len(a) == 1 else a) if a else None for a in dims])

    def sharding_for(
        self, path: str, shape: Sequence[int], logical_axes: Sequence[str | None] | None
    ) -> NamedSharding:
        """NamedSharding for one parameter: the callback a weight loader needs."""
        return NamedSharding(self.mesh, self.spec_for(path, shape, logical_axes))

    def activation_spec(self, shape: Sequence[int], names: Sequence[str | None]) -> P:
        """Spec for an activation; axes that do not divide are skipped (it is only a hint)."""
        out = []
        for size, name in zip(shape, names, strict=True):
            axes = self._live(_as_axes(ACTIVATION_RULES.get(name), "activation")) if name else ()
            out.append(
                (axes[0] if len(axes) == 1 else axes)
                if axes and size % self._size(axes) == 0
                else None
            )
        return P(*out)

    def tree_shardings(self, params: Any) -> Any:
        """Shardings shaped like `params` (an nnx.State of Variables, arrays or shape structs)."""
        by_path: dict[str, NamedSharding] = {}

        def visit(path, leaf):
            axes = None
            if isinstance(leaf, nnx.Variable):
                axes = leaf.get_metadata().get("logical_axes")
            by_path[path_str(path)] = self.sharding_for(path_str(path), leaf.shape, axes)
            return leaf

        jax.tree_util.tree_map_with_path(
            visit, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        return jax.tree_util.tree_map_with_path(lambda p, _: by_path[path_str(p)], params)
