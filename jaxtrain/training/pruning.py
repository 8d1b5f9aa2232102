"""Magnitude pruning on a schedule (the seeds' `pruning_module`), kept small on purpose.

No maintained JAX pruning library is installable here (jaxpruner is not on the package
index), so this is our own, and only the one method most runs want: gradual magnitude
pruning (Zhu and Gupta 2017, "To prune, or not to prune"). The sparsity of each targeted
matrix follows

    s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt)) ** 3      for t0 <= t <= t0 + n * dt

(t0 = pruning_begin_step, t0 + n * dt = pruning_end_step, dt = pruning_frequency, s_i = 0,
s_f = pruning_target_sparsity); every `frequency` steps, and at the end step, the smallest
|w| of each matrix are masked until it has that sparsity. A pruned weight stays pruned.

Where the masks live: in the optimizer state. `magnitude_pruning` wraps the run's optax
optimizer in a GradientTransformation whose state is `PruningState(masks, inner)`, so
  - checkpoints save and restore the masks with the rest of the optimizer state: a resume
    is bit-exact (a TrainState field would need its own path through checkpoints, the
    sharding plan and `reset_optimizer`; the optimizer state already has all three);
  - each mask is sharded like its parameter (parallel/zero.py matches a state leaf by path
    and shape) and is a bool: a quarter of a float32 parameter;
  - it all runs inside the compiled step: the update of a pruned weight is replaced by
    `-w`, so the weight is exactly 0 after `apply_updates`, and its gradient is masked
    before the inner optimizer (its moments do not grow). Kept weights get the inner
    update unchanged (bit for bit what the plain optimizer gives).
Non-targeted parameters get a scalar True placeholder, so the mask tree mirrors the params.
`reset_optimizer=True` on a resume also resets the masks: pruned weights are still 0 and are
pruned again at the next mask update, but may move until then.

Targets: `pruning_targets` regexes searched in the parameter path
('model/layers/0/mlp/down_proj/kernel'); by default every parameter with ndim >= 2 except
embeddings and norms. The step logs `sparsity`: the fraction of targeted weights pruned.
Choosing the k-th smallest magnitude sorts each matrix (gathered under sharding), but only
at mask updates (a lax.cond), not every step.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxtrain.config.sections import PruningSettings
from jaxtrain.errors import ArgumentError
from jaxtrain.pytrees import path_str

# Parameters never pruned by default: their rows are looked up (embeddings) or they scale
# whole features (norms); pruning them removes tokens or channels, not connections.
DEFAULT_EXCLUDED = ("embed", "norm")


class PruningState(NamedTuple):
    """The optimizer state of `magnitude_pruning`: the updates applied so far, a bool mask per
    parameter (a scalar True for those not pruned) and the wrapped optimizer's state."""

    count: jax.Array
    masks: Any
    inner: Any


def polynomial_sparsity(
    step: jax.Array, *, target: float, begin: int, end: int, initial: float = 0.0
) -> jax.Array:
    """Zhu and Gupta's cubic schedule at optimizer step `step` (clipped to [begin, end])."""
    progress = jnp.clip((step - begin) / max(end - begin, 1), 0.0, 1.0)
    progress = jnp.where(step >= end, 1.0, progress)  # also when begin == end
    return target + (initial - target) * (1.0 - progress) ** 3


def default_is_target(path: str, shape: Sequence[int]) -> bool:
    """Every parameter with ndim >= 2 except embeddings and norms."""
    parts = path.lower().split("/")
    return len(shape) >= 2 and not any(x in p for p in parts for x in DEFAULT_EXCLUDED)


def regex_targets(patterns: Sequence[str]) -> Callable[[str, Sequence[int]], bool]:
    """A parameter with ndim >= 2 whose path any of `patterns` searches."""
    compiled = [re.compile(p) for p in patterns]
    return lambda path, shape: len(shape) >= 2 and any(c.search(path) for c in compiled)


def _pruned(mask: jax.Array, weights: jax.Array, sparsity: jax.Array) -> jax.Array:
    """`mask` with the smallest-magnitude weights masked until `sparsity` of it is; weights
    already masked rank lowest, so they stay masked (ties at the cut are masked too)."""
    magnitude = jnp.where(mask, jnp.abs(weights).astype(jnp.float32), -1.0)
    flat = jnp.sort(magnitude.ravel())
    count = jnp.floor(sparsity * flat.size).astype(jnp.int32)
    cut = jnp.where(count > 0, flat[jnp.maximum(count - 1, 0)], -jnp.inf)
    return magnitude > cut


def magnitude_pruning(
    inner: optax.GradientTransformation,
    *,
    target_sparsity: float,
    begin_step: int,
    end_step: int,
    frequency: int,
    is_target: Callable[[str, Sequence[int]], bool] = default_is_target,
) -> optax.GradientTransformation:
    """`inner` with gradual magnitude pruning; masks are updated in the updates that produce
    steps begin_step, begin_step + frequency, ... and end_step (steps count from 1)."""

    def init(params: Any) -> PruningState:
        def mask(path: Any, p: Any) -> jax.Array:
            if is_target(path_str(path), p.shape):
                return jnp.ones(p.shape, jnp.bool_)
            return jnp.ones((), jnp.bool_)

        masks = jax.tree_util.tree_map_with_path(mask, params)
        if not any(m.ndim for m in jax.tree.leaves(masks)):
            names = ", ".join(path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params))
            raise ArgumentError(
                "TrainingArguments.pruning_targets matched no parameter with ndim >= 2. "
                f"Parameters are named: {names[:600]}. Fix the patterns."
            )
        return PruningState(jnp.zeros((), jnp.int32), masks, inner.init(params))

    def update(grads: Any, state: PruningState, params: Any = None) -> tuple[Any, PruningState]:
        masked = jax.tree.map(lambda g, m: jnp.where(m, g, 0) if m.ndim else g, grads, state.masks)
        updates, inner_state = inner.update(masked, state.inner, params)
        step = state.count + 1  # the step this update produces (a skipped one is no update)
        due = (step >= begin_step) & (step <= end_step)
        due &= ((step - begin_step) % frequency == 0) | (step == end_step)
        sparsity = polynomial_sparsity(step, target=target_sparsity, begin=begin_step, end=end_step)

        def new_masks() -> Any:
            return jax.tree.map(
                lambda m, p, u: _pruned(m, p + u, sparsity) if m.ndim else m,
                state.masks,
                params,
                updates,
            )

        masks = jax.lax.cond(due, new_masks, lambda: state.masks)
        # A pruned weight's update is -w: exactly 0 after apply_updates; the rest unchanged.
        updates = jax.tree.map(
            lambda u, p, m: jnp.where(m, u, -p).astype(u.dtype) if m.ndim else u,
            updates,
            params,
            masks,
        )
        return updates, PruningState(state.count + 1, masks, inner_state)

    return optax.GradientTransformation(init, update)


def sparsity(opt_state: Any) -> jax.Array:
    """The fraction of targeted weights pruned, from a `PruningState`."""
    masks = [m for m in jax.tree.leaves(opt_state.masks) if m.ndim]
    # Count the pruned weights, exactly (an int32 per matrix): 1 - kept / total in float32
    # rounds to -1.5e-08 and the like before the first mask update, where it must be 0.
    pruned = sum(jnp.sum(m == 0, dtype=jnp.int32).astype(jnp.float32) for m in masks)
    return pruned / sum(m.size for m in masks)


def pruning_metrics(state: Any) -> dict[str, jax.Array]:
    """What the train step logs about pruning (`sparsity`), from the state after the step."""
    if not isinstance(state.opt_state, PruningState):
        return {}
    return {"sparsity": sparsity(state.opt_state)}


def with_pruning(
    optimizer: optax.GradientTransformation, settings: PruningSettings, total_steps: int
) -> optax.GradientTransformation:
    """The run's optimizer, wrapped by `magnitude_pruning` when target_sparsity > 0."""
    if not settings.target_sparsity:
        return optimizer
    end = settings.end_step if settings.end_step is not None else total_steps
    if not settings.begin_step < end <= total_steps:
        raise ArgumentError(
            f"TrainingArguments.pruning_end_step={end} must lie after pruning_begin_step="
            f"{settings.begin_step} and within the run's {total_steps} steps, or the "
            "target sparsity is never reached. Lower pruning_begin_step/pruning_end_step."
        )
    targets = settings.targets
    return magnitude_pruning(
        optimizer,
        target_sparsity=settings.target_sparsity,
        begin_step=settings.begin_step,
        end_step=end,
        frequency=settings.frequency,
        is_target=regex_targets(targets) if targets else default_is_target,
    )
