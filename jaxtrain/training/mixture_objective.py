"""Per-source sums of a mixture's batches, added to the objective's own (objective.py).

A mixture's batch carries `source_ids` [M] per micro-batch (data/mixture.py): the index of
each row's source in `names`. For every source the step then also returns

  mixture/<name>/share_sum, _count   its target tokens, over the batch's: logged as the
                                     source's share of the window's tokens (of its rows,
                                     when the batch has no per-token labels)
  mixture/<name>/loss_sum, _count    the cross-entropy summed over its target tokens, over
                                     their number: the source's loss (the default causal LM
                                     objective only, whose per-row sums come from the same
                                     logits as the loss itself: no second forward pass)

By the rule of objective.py each `X_sum` is averaged over its own `X_count` across the
logging window, so the logged per-source loss is token-weighted like the loss. None of these
carries a gradient; the update is the objective's alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.training.program import Objective
from jaxtrain.training.step import causal_lm_loss_rows

__all__ = ["mixture_objective", "source_sums"]


def source_sums(
    names: Sequence[str], batch: dict[str, jax.Array], rows: dict[str, jax.Array] | None = None
) -> dict[str, jax.Array]:
    """The per-source sums of a micro-batch (module docstring); {} without `source_ids` (an
    eval batch). `rows`: each row's {"nll", "tokens"} [M], for the per-source loss."""
    ids = batch.get("source_ids")
    if ids is None:
        return {}
    one_hot = (ids[:, None] == jnp.arange(len(names))[None, :]).astype(jnp.float32)  # [M, K]
    labels = batch.get("labels")
    if rows is not None:
        units = rows["tokens"]
    elif labels is not None and labels.ndim == 2:  # per-token labels: count target tokens
        units = (labels[:, 1:] != IGNORE_INDEX).sum(-1).astype(jnp.float32)
    else:  # one label per row (or none): each row is one unit
        units = jnp.ones(ids.shape, jnp.float32)
    per_source = units @ one_hot
    total = units.sum()
    out = {}
    for k, name in enumerate(names):
        out[f"mixture/{name}/share_sum"] = per_source[k]
        out[f"mixture/{name}/share_count"] = total
    if rows is not None:
        nll = rows["nll"] @ one_hot
        for k, name in enumerate(names):
            out[f"mixture/{name}/loss_sum"] = nll[k]
            out[f"mixture/{name}/loss_count"] = per_source[k]
    return jax.lax.stop_gradient(out)


def mixture_objective(base: Objective, names: Sequence[str], *, lm_rows: bool) -> Objective:
    """`base` with the per-source sums of `names` added. `lm_rows`: `base` is the default
    causal LM objective, whose per-row sums give each source's loss."""
    names = tuple(names)
    if lm_rows:

        def loss_sums(model, batch, rng):
            sums, rows = causal_lm_loss_rows(model, batch, rng)
            return {**sums, **source_sums(names, batch, rows)}

    else:

        def loss_sums(model, batch, rng):
            return {**base.loss_sums(model, batch, rng), **source_sums(names, batch)}

    return dataclasses.replace(base, loss_sums=loss_sums)
