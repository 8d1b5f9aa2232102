"""ORPO (Hong et al. 2024, "Monolithic Preference Optimization without Reference Model").

With p_c, p_r the chosen and rejected responses' mean per-token log-probs (the length-
normalised likelihoods), odds(y) = p / (1 - p) in probability space, and

    log_odds = (p_c - p_r) - (log(1 - e^p_c) - log(1 - e^p_r)),

the loss of an update is NLL(chosen) - beta * mean over pairs of log sigmoid(log_odds), the
NLL a token mean over every chosen sequence's tokens but the first (prompt included, as TRL's
ORPOTrainer computes it). No reference model: one forward of the policy per pair.

On the objective contract the NLL's token mean becomes a per-pair sum: each micro-batch adds
its NLL sum times (pairs / NLL tokens) of the whole global batch (`global_scalars`), so the
update's loss_sum / pairs is exactly the formula above over the global batch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.config.sections import RunSettings
from jaxtrain.task_arguments import ORPOArguments
from jaxtrain.trainers.base import (
    PairTrainer,
    TaskStart,
    concrete_model,
    pair_normalizer,
    task_arguments,
)
from jaxtrain.trainers.frozen import TaskModel
from jaxtrain.trainers.sequences import (
    full_target_count,
    preference_sums,
    real_units,
    sequence_logps,
    unit_count,
)
from jaxtrain.training.program import Objective

__all__ = ["ORPOArguments", "ORPOTrainer", "log1mexp", "orpo_objective", "odds_ratio_terms"]

NLL_SCALE = "orpo/pairs_per_nll_token"  # the global scalar the NLL sum is scaled by


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - e^x) for x < 0, accurate on both sides of -ln 2 (Maechler 2012)."""
    return jnp.where(x < -jnp.log(2.0), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def odds_ratio_terms(chosen: jax.Array, rejected: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log sigmoid(log_odds), log_odds) per pair from mean per-token log-probs [N]."""
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    return jax.nn.log_sigmoid(log_odds), log_odds


def orpo_loss_sums(policy: Any, batch: dict[str, jax.Array], beta: float) -> dict[str, jax.Array]:
    """The objective's sums over a batch of pairs (per pair, but `nll_loss`: per token);
    `beta` weighs the odds-ratio term."""
    n = unit_count(batch)
    s = sequence_logps(policy, batch, full=True)
    c_n, r_n = (jnp.maximum(s.side("tokens", k, n), 1.0) for k in (0, 1))
    real = real_units(batch)
    # An empty slot (a filler row, a packed batch's unused unit) has log-prob 0, whose odds
    # are infinite: give it a finite stand-in so no NaN reaches the sums or the gradient.
    chosen, rejected = (
        jnp.where(real > 0, s.side("logps", k, n) / count, -1.0)
        for k, count in ((0, c_n), (1, r_n))
    )
    ratio, log_odds = odds_ratio_terms(chosen, rejected)
    nll_sum = -(s.side("full_logps", 0, n) * real).sum()
    nll_tokens = (s.side("full_tokens", 0, n) * real).sum()
    scale = batch[NLL_SCALE] if NLL_SCALE in batch else real.sum() / jnp.maximum(nll_tokens, 1.0)
    stop = jax.lax.stop_gradient
    reward_chosen, reward_rejected = beta * stop(chosen), beta * stop(rejected)
    return {
        "loss_sum": nll_sum * scale - beta * (ratio * real).sum(),
        **preference_sums(reward_chosen, reward_rejected, chosen, rejected, real),
        "nll_loss_sum": stop(nll_sum),
        "nll_loss_count": nll_tokens,
        "log_odds_ratio_sum": (stop(ratio) * real).sum(),
        "log_odds_chosen_sum": (stop(log_odds) * real).sum(),
    }


def orpo_objective(settings: RunSettings) -> Objective:
    """ORPO's objective on a TaskModel without frozen parts."""

    def loss_sums(model: TaskModel, batch: dict[str, jax.Array], rng: jax.Array):
        del rng
        return orpo_loss_sums(model.model, batch, settings.task.beta)

    def scalars(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        tokens = jnp.maximum(full_target_count(batch, side=0), 1.0)
        return {NLL_SCALE: pair_normalizer(batch) / tokens}

    return Objective(
        loss_sums=loss_sums, normalizer=pair_normalizer, token_nll=False, global_scalars=scalars
    )


class ORPOTrainer(PairTrainer):
    """Train a policy on (prompt, chosen, rejected) pairs with ORPO: no reference model.

    Logged (per pair, nll_loss per token): loss, accuracy (= rewards/accuracies),
    rewards/chosen, rewards/rejected, rewards/margins (beta x mean log-probs), logps/chosen,
    logps/rejected (mean per-token log-probs), nll_loss, log_odds_ratio, log_odds_chosen.
    """

    def __init__(self, arguments: ORPOArguments | None = None, model: Any = None, **kwargs: Any):
        args = task_arguments(arguments, ORPOArguments, type(self).__name__)
        start = TaskStart.resolve(args, kwargs)
        model = concrete_model(model, start.settings.model, start.runtime)
        objective = orpo_objective(start.settings)
        super().__init__(
            **start.trainer_kwargs(arguments=args, model=TaskModel(model), objective=objective)
        )
