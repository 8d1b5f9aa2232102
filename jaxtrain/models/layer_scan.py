"""A decoder's layers run under ``jax.lax.scan``, its parameter tree unchanged.

The layers stay an ``nnx.List`` of per-layer modules (parameter names, checkpoints, Hugging
Face weight maps, LoRA targets, quantized bases and sharding rules see ``layers.3....`` as
before). At call time each layer is split into its graphdef and state, the states are
stacked leaf by leaf, and one scan step merges a layer's slice and applies it: the layer's
Python body is traced and compiled once, not once per layer, so compile time no longer grows
with depth. Gradients flow back through the stack to the per-layer parameters.

Layers scan together when they are the same module: equal graphdefs (static attributes
included: Gemma's sliding window, a LoRA adapter's part) and equal leaf shapes and dtypes.
A pattern that repeats with a period (Gemma's sliding/full alternation, a MoE model's dense
and sparse layers) scans over groups of one period, the layers past the last whole group
run after it one by one; layers that repeat no pattern run one by one, as without scan.

A quantized base is not stacked: its integer codes (leaves of an integer dtype, which no
gradient reaches) are read by each scan step from the layer it runs, through a switch on the
step's index, so neither a stacked copy of the base's codes nor every layer's float kernels
exist at once; each layer dequantizes its own kernels inside its step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config.tables import REMAT_POLICIES

__all__ = ["LayerStep", "checkpoint_policy", "layer_period", "run_layers"]

Array = jax.Array

# step(layer, x, inputs) -> (x, aux): one layer applied to the residual stream `x`; `inputs`
# are the arrays every layer reads (rotary tables, segment ids), `aux` an optional per-layer
# output (a MoE layer's router statistics; None for most layers).
LayerStep = Callable[[nnx.Module, Array, Any], tuple[Array, Any]]

# Where a traced array that a layer holds as a plain attribute sits: (module path, name).
AttrPath = tuple[tuple[Any, ...], str]


def checkpoint_policy(name: str):
    """Map a REMAT_POLICIES name to a jax.checkpoint policy.

    "dots_saveable" keeps the outputs of matmuls WITHOUT batch dims (the weight
    projections) and recomputes the batched attention einsums, whose [B, N, T, T] scores
    are the memory that grows with sequence length. That is
    ``dots_with_no_batch_dims_saveable``, the usual "save the projections" choice.
    """
    policies = jax.checkpoint_policies
    if name == "nothing_saveable":
        return policies.nothing_saveable
    if name == "dots_saveable":
        return policies.dots_with_no_batch_dims_saveable
    if name == "everything_saveable":
        return policies.everything_saveable
    raise ValueError(f"remat_policy={name!r} is not one of {REMAT_POLICIES}; pick one of them.")


def array_attributes(layer: nnx.Module) -> list[AttrPath]:
    """Where `layer` holds a jax array as a plain attribute (LoRA's per-step dropout key).
    Such an attribute is static for nnx.split, so it would land in the graphdef, differ per
    layer and refuse comparison when traced; the scan carries it as a scanned input."""
    return [
        (path, name)
        for path, module in nnx.iter_modules(layer)
        for name, value in vars(module).items()
        if isinstance(value, jax.Array)
    ]


@contextlib.contextmanager
def _arrays_lifted(layer: nnx.Module, where: list[AttrPath]) -> Iterator[list[Array]]:
    """Inside: the attributes at `where` are None on `layer`; yields their values."""
    modules = dict(nnx.iter_modules(layer))
    values = [getattr(modules[path], name) for path, name in where]
    for path, name in where:
        setattr(modules[path], name, None)
    try:
        yield values
    finally:
        for (path, name), value in zip(where, values):
            setattr(modules[path], name, value)


def _set_arrays(layer: nnx.Module, where: list[AttrPath], values: Sequence[Array]) -> None:
    modules = dict(nnx.iter_modules(layer))
    for (path, name), value in zip(where, values):
        setattr(modules[path], name, value)


class _Split:
    """One layer as pure data: graphdef, state, lifted array attributes (and where)."""

    def __init__(self, layer: nnx.Module):
        self.where = array_attributes(layer)
        with _arrays_lifted(layer, self.where) as arrays:
            self.graphdef, self.state = nnx.split(layer)
        self.arrays = arrays

    def same_as(self, other: _Split) -> bool:
        """Whether one scan step can run both layers: same module, same leaf shapes."""

        def avals(tree: Any) -> tuple[Any, Any]:
            leaves, treedef = jax.tree.flatten(tree)
            return treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)

        if self.where != other.where:
            return False
        try:
            same_graph = bool(self.graphdef == other.graphdef)
        except (TypeError, ValueError):  # an unhashable static attribute: no scan
            return False
        return same_graph and avals((self.state, self.arrays)) == avals((other.state, other.arrays))


def layer_period(layers: Sequence[nnx.Module]) -> int | None:
    """The shortest period p with which the layers repeat (layer i is the same module as
    layer i % p) and at least two whole groups; None when there is none (no scan)."""
    return _period([_Split(layer) for layer in layers])


def _period(splits: Sequence[_Split]) -> int | None:
    n = len(splits)
    for p in range(1, n // 2 + 1):
        if all(splits[i].same_as(splits[i % p]) for i in range(p, n)):
            return p
    return None


def _pure_step(
    split: _Split,
    step: LayerStep,
    remat_policy: str,
    prevent_cse: bool,
    state_of: Callable[[Any], Any] = lambda state: state,
) -> Callable[..., tuple[Array, Any]]:
    """step as a pure function of (state, arrays, x, inputs), rematerialised by the policy.
    The state is an explicit argument of jax.checkpoint (not nnx.remat): under jax.grad
    nnx.remat refuses to write back a layer's non-Param variables (LoRA's frozen base, a
    quantized base, a frozen reference; Flax 0.12). `state_of` makes the layer's state of
    what the scan hands the step (inside the checkpoint, so remat recomputes it)."""
    graphdef, where = split.graphdef, split.where

    def pure(state: Any, arrays: Sequence[Array], x: Array, inputs: Any) -> tuple[Array, Any]:
        layer = nnx.merge(graphdef, state_of(state))
        _set_arrays(layer, where, arrays)
        return step(layer, x, inputs)

    if remat_policy == "none":
        return pure
    policy = checkpoint_policy(remat_policy)
    return jax.checkpoint(pure, policy=policy, prevent_cse=prevent_cse)


def _stack(trees: Sequence[Any]) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


class _Position:
    """The layers at one position of the scanned groups (layers j, j + p, j + 2p, ...): the
    float leaves of their states stacked for the scan; the integer leaves left per layer,
    picked by the step's group index (``state_of``) instead of copied into a stack."""

    def __init__(self, splits: Sequence[_Split]):
        flat = [jax.tree.flatten(s.state) for s in splits]
        leaves, self.treedef = [f[0] for f in flat], flat[0][1]
        self.integer = [jnp.issubdtype(jnp.result_type(x), jnp.integer) for x in leaves[0]]
        self.per_layer = [[x for x, i in zip(ls, self.integer) if i] for ls in leaves]
        floats = [[x for x, i in zip(ls, self.integer) if not i] for ls in leaves]
        self.stacked = _stack(floats)

    def state_of(self, scanned: tuple[list[Array], Array]) -> Any:
        """A layer's state from its scan slice: (its float leaves, its group index)."""
        floats, group = scanned
        ints = ()
        if self.per_layer[0]:
            branches = [lambda layer=layer: tuple(layer) for layer in self.per_layer]
            ints = jax.lax.switch(group, branches)
        it_float, it_int = iter(floats), iter(ints)
        leaves = [next(it_int) if i else next(it_float) for i in self.integer]
        return jax.tree.unflatten(self.treedef, leaves)


def run_layers(
    layers: Sequence[nnx.Module],
    step: LayerStep,
    x: Array,
    inputs: Any = None,
    *,
    scan: bool,
    remat_policy: str = "none",
    layer_inputs: Sequence[Any] | None = None,
) -> tuple[Array, list[Any]]:
    """`x` through every layer in order: ``x, aux_i = step(layer_i, x, inputs)``; returns the
    final `x` and the per-layer `aux` in layer order. With `scan`, layers that repeat (see
    the module docstring) run under one jax.lax.scan; the result is the loop's.
    `remat_policy` (REMAT_POLICIES) rematerialises each layer either way. `layer_inputs`:
    one value per layer (a MoE layer's replayed routing; None where a layer has none), handed
    to the step as ``(inputs, layer_inputs[i])``."""
    if remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={remat_policy!r} is not one of {REMAT_POLICIES}.")
    n = len(layers)
    per_layer = [inputs] * n if layer_inputs is None else [(inputs, v) for v in layer_inputs]
    splits = [_Split(layer) for layer in layers] if (scan or remat_policy != "none") else []
    period = _period(splits) if scan else None
    if period is None:
        return _loop(layers, splits, step, x, per_layer, remat_policy)
    groups = n // period
    # prevent_cse=False inside scan: the loop already keeps XLA from merging the recompute
    # into the forward pass (jax.checkpoint's documentation), and CSE barriers cost speed.
    members = [range(j, groups * period, period) for j in range(period)]
    positions = [_Position([splits[i] for i in m]) for m in members]
    fns = [
        _pure_step(splits[j], step, remat_policy, False, positions[j].state_of)
        for j in range(period)
    ]
    # xs[j]: the float states (and array attributes) of layers j, j + p, j + 2p, ... stacked.
    # The per-layer inputs ride along in xs; the shared ones are closed over.
    shared = layer_inputs is None
    xs = tuple(
        (position.stacked,
         _stack([(splits[i].arrays, None if shared else layer_inputs[i]) for i in m]))
        for position, m in zip(positions, members)
    )  # fmt: skip

    def body(x: Array, scanned: tuple[Array, tuple[Any, ...]]) -> tuple[Array, tuple[Any, ...]]:
        index, group = scanned
        auxes = []
        for fn, (floats, (arrays, own)) in zip(fns, group):
            x, aux = fn((floats, index), arrays, x, inputs if shared else (inputs, own))
            auxes.append(aux)
        return x, tuple(auxes)

    x, stacked = jax.lax.scan(body, x, (jnp.arange(groups), xs))
    # Layer i's aux is row i // p of what position i % p of the group returned.
    aux = [
        jax.tree.map(lambda a, row=i // period: a[row], stacked[i % period])
        for i in range(groups * period)
    ]
    tail = slice(groups * period, n)
    x, tail_aux = _loop(layers[tail], splits[tail], step, x, per_layer[tail], remat_policy)
    return x, aux + tail_aux


def _loop(
    layers: Sequence[nnx.Module],
    splits: Sequence[_Split],
    step: LayerStep,
    x: Array,
    per_layer: Sequence[Any],
    remat_policy: str,
) -> tuple[Array, list[Any]]:
    """The layers one by one, each traced on its own (`per_layer`: each one's inputs)."""
    aux = []
    for i, (layer, inputs) in enumerate(zip(layers, per_layer)):
        if remat_policy == "none":
            x, a = step(layer, x, inputs)
        else:
            s = splits[i]
            x, a = _pure_step(s, step, remat_policy, True)(s.state, s.arrays, x, inputs)
        aux.append(a)
    return x, aux
