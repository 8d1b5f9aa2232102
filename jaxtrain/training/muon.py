"""Muon's update of the hidden matrices, each orthogonalised whole, on any mesh.

Muon (Jordan et al. 2024) keeps a momentum per matrix and steps along its orthogonalised
direction: the Newton-Schulz iteration X <- a X + (b A + c A^2) X, A = X X^T (a quintic
pushing every singular value of the Frobenius-normalised momentum towards 1), five times.

Under fsdp and tp a matrix is split over devices. Run on the split matrix, the iteration is
still the whole matrix's (inside jit every array is global and XLA inserts the collectives),
but every one of its 15 matmuls then waits on a collective, and its float sums are formed in
another order than on one device. Here each matrix is orthogonalised whole on one device
instead (the "Distributed Muon" of Liu et al. 2025): every matrix's momentum is gathered
whole (an all-gather, as fsdp's forward pass does for the weights), the matrices of one shape
are stacked and split over every device of the mesh by whole matrices (padded with zero
matrices to a multiple of the devices), each device runs the iteration on its own matrices,
one after the other, and the results are gathered back and cut to the parameters' shardings.
The iteration is then the one-device computation, matrix by matrix, and its work is divided
over the devices by matrices. tests/parallel/test_muon_mesh.py holds an update on a dp, fsdp
and tp mesh within a relative 1e-6 of one device's (the gathers and the rest of the update
may sum in another order), and a run resumed on the mesh bit-exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers

__all__ = ["MuonMomentum", "newton_schulz", "orthogonalised_momentum"]

# Keller Jordan's quintic: the fastest rise of small singular values that keeps all of them
# within ~[0.7, 1.2] after five steps.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


class MuonMomentum(NamedTuple):
    mu: Any  # one momentum per orthogonalised matrix (float32)


def newton_schulz(x: jax.Array, eps: float) -> jax.Array:
    """The orthogonalised direction of one matrix [m, n] with m <= n (float32)."""
    a, b, c = NS_COEFFICIENTS
    x = x / (jnp.linalg.norm(x) + eps)
    for _ in range(NS_STEPS):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def _axes(axis: int | tuple[int, ...]) -> tuple[int, ...]:
    return axis if isinstance(axis, tuple) else (axis,)


def _as_matrices(x: jax.Array, spec: MuonDimensionNumbers) -> tuple[jax.Array, Callable]:
    """`x` as wide matrices [batch, m, n] (m <= n), and the map back to x's layout."""
    reduce, out = _axes(spec.reduction_axis), _axes(spec.output_axis)
    batch = tuple(i for i in range(x.ndim) if i not in reduce + out)
    order = batch + reduce + out
    moved = x.transpose(order)
    fan_in = math.prod(x.shape[i] for i in reduce)
    fan_out = math.prod(x.shape[i] for i in out)
    mats = moved.reshape(-1, fan_in, fan_out)
    wide = fan_in <= fan_out
    if not wide:
        mats = mats.swapaxes(1, 2)
    inverse_order = tuple(sorted(range(x.ndim), key=lambda i: order[i]))

    def back(y: jax.Array) -> jax.Array:
        y = y if wide else y.swapaxes(1, 2)
        return y.reshape(moved.shape).transpose(inverse_order)

    return mats, back


def _one_by_one(stack: jax.Array, eps: float) -> jax.Array:
    """Newton-Schulz of each matrix of a stack [k, m, n], one after the other: plain 2-D
    matmuls whatever k is, so a matrix's result does not depend on how many share a device
    (a batched matmul's rounding does)."""
    return jax.lax.map(lambda m: newton_schulz(m, eps), stack)


def _orthogonalise(
    items: list[tuple[jax.Array, MuonDimensionNumbers]], eps: float, mesh: Mesh | None
) -> list[jax.Array]:
    """Each item's matrices orthogonalised, those of one shape in one stack spread over the
    mesh's devices by whole matrices (see the module docstring)."""
    devices = 1 if mesh is None else mesh.size
    whole = None if mesh is None else NamedSharding(mesh, P())
    shaped = []
    for x, spec in items:
        if whole is not None:  # gathered whole: an explicit all-gather, like fsdp's own
            x = jax.lax.with_sharding_constraint(x, whole)
        shaped.append(_as_matrices(x.astype(jnp.float32), spec))
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (mats, _) in enumerate(shaped):
        groups.setdefault(mats.shape[1:], []).append(i)
    results: list[jax.Array | None] = [None] * len(items)
    for members in groups.values():
        stack = jnp.concatenate([shaped[i][0] for i in members])
        pad = -stack.shape[0] % devices
        if pad:
            stack = jnp.concatenate([stack, jnp.zeros((pad, *stack.shape[1:]), stack.dtype)])
        if devices == 1:
            done = _one_by_one(stack, eps)
        else:  # each device its own whole matrices
            by_matrix = P(mesh.axis_names, None, None)
            stack = jax.lax.with_sharding_constraint(stack, NamedSharding(mesh, by_matrix))
            done = jax.shard_map(
                lambda local: _one_by_one(local, eps),
                mesh=mesh,
                in_specs=by_matrix,
                out_specs=by_matrix,
            )(stack)
            done = jax.lax.with_sharding_constraint(done, whole)  # back to every device
        at = 0
        for i in members:
            mats, back = shaped[i]
            results[i] = back(done[at : at + mats.shape[0]])
            at += mats.shape[0]
    return results


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def orthogonalised_momentum(
    specs: Callable[[Any], Any],
    *,
    beta: float,
    eps: float,
    mesh: Mesh | None = None,
    mu_dtype: Any = None,
) -> optax.GradientTransformation:
    """Nesterov momentum (mu <- beta mu + (1 - beta) g; step along beta mu + (1 - beta) g),
    orthogonalised matrix by matrix. `specs(tree)`: the MuonDimensionNumbers of each leaf of
    the tree the transformation sees (MaskedNode where optax.partition masked a leaf). mu is
    kept in `mu_dtype` (default float32), computed in float32."""
    kept = jnp.dtype(mu_dtype or jnp.float32)

    def init(params: Any) -> MuonMomentum:
        return MuonMomentum(jax.tree.map(lambda p: jnp.zeros(p.shape, kept), params))

    def update(updates: Any, state: MuonMomentum, params: Any = None):
        del params
        mix = lambda g, m: beta * m + (1 - beta) * g.astype(jnp.float32)  # noqa: E731
        mu = jax.tree.map(mix, updates, state.mu)
        direction = jax.tree.map(mix, updates, mu)
        leaves, treedef = jax.tree.flatten(direction, is_leaf=_is_masked)
        spec_leaves = jax.tree.leaves(
            specs(updates), is_leaf=lambda x: _is_masked(x) or isinstance(x, MuonDimensionNumbers)
        )
        real = [i for i, x in enumerate(leaves) if not _is_masked(x)]
        done = _orthogonalise([(leaves[i], spec_leaves[i]) for i in real], eps, mesh)
        for i, y in zip(real, done):
            leaves[i] = y.astype(leaves[i].dtype)
        return jax.tree.unflatten(treedef, leaves), MuonMomentum(
            jax.tree.map(lambda m: m.astype(kept), mu)
        )

    return optax.GradientTransformation(init, update)
