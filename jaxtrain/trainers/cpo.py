"""CPO (Xu et al. 2024, "Contrastive Preference Optimization") and SimPO (Meng et al. 2024).

DPO without a reference model plus a behaviour-cloning term. With c, r the policy's
log-probs of the chosen and rejected responses (sums over the response tokens; means per
token for `ipo` and `simpo`) and h = c - r, the per-pair losses are

- sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps: label_smoothing)
- hinge:   max(0, 1 - beta h)
- ipo:     (h - 1 / (2 beta))^2
- simpo:   sigmoid's, with h - gamma / beta in place of h (a target margin gamma)

and the loss of an update is their mean over pairs + cpo_alpha * NLL, the NLL a token mean of
the chosen responses' tokens (as TRL's CPOTrainer; its token mean over the whole global batch
comes from `global_scalars`, as ORPO's). SimPO is loss_type="simpo" with cpo_alpha=0.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.config.sections import RunSettings
from jaxtrain.task_arguments import CPO_LOSS_TYPES, CPOArguments
from jaxtrain.trainers.base import (
    PairTrainer,
    TaskStart,
    concrete_model,
    pair_normalizer,
    task_arguments,
)
from jaxtrain.trainers.frozen import TaskModel
from jaxtrain.trainers.sequences import (
    preference_sums,
    real_units,
    response_token_count,
    sequence_logps,
    unit_count,
)
from jaxtrain.training.program import Objective

__all__ = ["CPOArguments", "CPOTrainer", "cpo_losses", "cpo_objective"]

NLL_SCALE = "cpo/pairs_per_nll_token"  # the global scalar the NLL sum is scaled by


def cpo_losses(
    chosen: jax.Array,
    rejected: jax.Array,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.0,
) -> jax.Array:
    """Per-pair losses from the policy's log-probs of chosen and rejected ([N] each)."""
    h = chosen - rejected
    if loss_type == "simpo":
        h = h - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        return -(1 - label_smoothing) * jax.nn.log_sigmoid(
            beta * h
        ) - label_smoothing * jax.nn.log_sigmoid(-beta * h)
    if loss_type == "hinge":
        return jax.nn.relu(1 - beta * h)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown CPO loss_type {loss_type!r}; use one of {CPO_LOSS_TYPES}")


def cpo_loss_sums(policy: Any, batch: dict[str, jax.Array], task: Any) -> dict[str, jax.Array]:
    """The objective's sums over a batch of pairs (per pair, but `nll_loss`: per token);
    `task`: CPOArguments' section (beta, loss_type, label_smoothing, cpo_alpha, simpo_gamma)."""
    n = unit_count(batch)
    s = sequence_logps(policy, batch)
    chosen, rejected = s.side("logps", 0, n), s.side("logps", 1, n)
    chosen_n, rejected_n = s.side("tokens", 0, n), s.side("tokens", 1, n)
    real = real_units(batch)
    nll_sum = -(chosen * real).sum()  # the chosen responses' summed log-probs
    nll_tokens = (chosen_n * real).sum()
    if task.loss_type in ("ipo", "simpo"):  # length-normalised: mean per-token log-probs
        chosen, rejected = (
            chosen / jnp.maximum(chosen_n, 1.0),
            rejected / jnp.maximum(rejected_n, 1.0),
        )
    losses = cpo_losses(
        chosen,
        rejected,
        beta=task.beta,
        loss_type=task.loss_type,
        label_smoothing=task.label_smoothing,
        simpo_gamma=task.simpo_gamma,
    )
    scale = batch[NLL_SCALE] if NLL_SCALE in batch else real.sum() / jnp.maximum(nll_tokens, 1.0)
    stop = jax.lax.stop_gradient
    reward_chosen, reward_rejected = task.beta * stop(chosen), task.beta * stop(rejected)
    sums = {
        "loss_sum": (losses * real).sum() + task.cpo_alpha * nll_sum * scale,
        **preference_sums(reward_chosen, reward_rejected, chosen, rejected, real),
    }
    if task.cpo_alpha:  # without the term TRL logs no NLL (a 0), nor does jaxtrain
        sums["nll_loss_sum"] = stop(nll_sum)
        sums["nll_loss_count"] = nll_tokens
    return sums


def cpo_objective(settings: RunSettings) -> Objective:
    """CPO's (or SimPO's) objective on a TaskModel without frozen parts."""
    task = settings.task

    def loss_sums(model: TaskModel, batch: dict[str, jax.Array], rng: jax.Array):
        del rng
        return cpo_loss_sums(model.model, batch, task)

    def scalars(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        tokens = jnp.maximum(response_token_count(batch, side=0), 1.0)
        return {NLL_SCALE: pair_normalizer(batch) / tokens}

    return Objective(
        loss_sums=loss_sums,
        normalizer=pair_normalizer,
        token_nll=False,
        global_scalars=scalars if task.cpo_alpha else None,
    )


class CPOTrainer(PairTrainer):
    """Train a policy on (prompt, chosen, rejected) pairs with CPO, or SimPO
    (`loss_type="simpo"`, `cpo_alpha=0`): no reference model.

    Logged (per pair, nll_loss per token): loss, accuracy (= rewards/accuracies),
    rewards/chosen, rewards/rejected, rewards/margins (beta x the log-probs the loss compares),
    logps/chosen, logps/rejected, nll_loss (when cpo_alpha > 0).
    """

    def __init__(self, arguments: CPOArguments | None = None, model: Any = None, **kwargs: Any):
        args = task_arguments(arguments, CPOArguments, type(self).__name__)
        start = TaskStart.resolve(args, kwargs)
        model = concrete_model(model, start.settings.model, start.runtime)
        objective = cpo_objective(start.settings)
        super().__init__(
            **start.trainer_kwargs(arguments=args, model=TaskModel(model), objective=objective)
        )
