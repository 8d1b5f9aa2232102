"""RLOO (REINFORCE leave-one-out; Ahmadian et al. 2024) as TRL 1.16's RLOOTrainer, on GRPO's
rollouts (the engine, reward functions, tools, exact resume: grpo_source.py).

What differs from GRPO:
- the KL to the reference is a penalty on the reward, taken when the completions are sampled:
  R' = R - beta x sum over the completion's tokens of (log pi_old - log pi_ref) (TRL's k1
  estimator, summed), and logged as `kl` (its mean per token);
- the baseline of a completion is the mean R' of the other completions of its prompt:
  A = R' - (sum of the group's R' - R') / (k - 1), with k the group's scored completions,
  optionally normalized over the batch;
- one ratio per completion, exp of the sum of its tokens' log-ratios, clipped to
  [1 - epsilon, 1 + epsilon_high]; the loss is the mean over completions, with no KL term.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.config.sections import RunSettings
from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.models.lora import adapters_off
from jaxtrain.rollout_arguments import RLOOArguments
from jaxtrain.trainers.grpo import GRPOTrainer
from jaxtrain.trainers.grpo_loss import grpo_normalizer, quiet_nan_warnings
from jaxtrain.trainers.grpo_source import RolloutSource
from jaxtrain.training.logps import model_token_logps
from jaxtrain.training.program import Objective

__all__ = ["RLOOArguments", "RLOOTrainer", "rloo_advantages", "rloo_objective"]


def rloo_advantages(
    rewards: np.ndarray,
    kl: np.ndarray,
    *,
    beta: float,
    num_generations: int,
    normalize: bool = False,
    clip_range: tuple[float, float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages [N], each group's penalized rewards all equal [N]) from the weighted
    rewards [N] (NaN: no function scored the completion) and each completion's summed KL [N],
    in consecutive groups of num_generations. A NaN reward, or a group with one scored
    completion, gets advantage 0."""
    r = np.asarray(rewards, np.float64)
    if clip_range is not None:
        r = np.clip(r, clip_range[0], clip_range[1])
    r = r - beta * np.asarray(kl, np.float64)  # NaN stays NaN
    groups = r.reshape(-1, num_generations)
    with np.errstate(invalid="ignore", divide="ignore"), quiet_nan_warnings():
        scored = (~np.isnan(groups)).sum(1, keepdims=True)
        others = (np.nansum(groups, 1, keepdims=True) - groups) / (scored - 1)
        advantages = (groups - others).ravel()
        if normalize:
            advantages = (advantages - np.nanmean(advantages)) / (
                np.nanstd(advantages, ddof=1) + 1e-4
            )
        group_std = np.nanstd(groups, axis=1, ddof=1)
    # A group of one scored completion has no std: not "equal" (as TRL counts it).
    equal = np.repeat(np.isclose(group_std, 0.0), num_generations)
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32), equal


def rloo_objective(settings: RunSettings) -> Objective:
    """RLOO's objective: a clipped ratio per completion (the sum of its log-ratios) times its
    advantage, averaged over completions. Logs the entropy (per token) and the share of
    clipped completions (TRL's clip_ratio/low_mean, high_mean, region_mean)."""
    task = settings.task
    low_bound, high_bound = 1.0 - task.epsilon, 1.0 + task.epsilon_high

    def loss_sums(model: Any, batch: dict[str, jax.Array], rng: jax.Array):
        del rng
        ids, labels = batch["input_ids"], batch["labels"]
        logps, mask, entropy = model_token_logps(
            model.model, ids, labels, entropy=True, temperature=task.temperature,
            pixel_values=batch.get("pixel_values"), routing=batch.get("routing"),
        )  # fmt: skip
        mask = mask.astype(jnp.float32)
        sequence = (logps * mask).sum(-1)
        if "old_logps" in batch:  # a later update of the round: the sampling policy's
            old = (batch["old_logps"] * mask).sum(-1)
        else:  # on-policy: the ratio is 1, its gradient the policy gradient
            old = jax.lax.stop_gradient(sequence)
        ratio = jnp.exp(sequence - old)
        advantages = batch["advantages"].astype(jnp.float32)
        clipped = jnp.clip(ratio, low_bound, high_bound)
        per_completion = -jnp.minimum(ratio * advantages, clipped * advantages)
        low = ((ratio < low_bound) & (advantages < 0)).astype(jnp.float32)
        high = ((ratio > high_bound) & (advantages > 0)).astype(jnp.float32)
        return {
            "loss_sum": per_completion.sum(),
            "tokens": jnp.float32(ids.shape[0]),  # the unit is the completion
            "entropy_sum": (jax.lax.stop_gradient(entropy) * mask).sum(),
            "entropy_count": mask.sum(),
            "clip_ratio/low_mean": low.sum(),
            "clip_ratio/high_mean": high.sum(),
            "clip_ratio/region_mean": jnp.maximum(low, high).sum(),
        }

    def normalizer(batch: dict[str, jax.Array]) -> jax.Array:
        return grpo_normalizer("grpo", batch["labels"][..., 1:] != IGNORE_INDEX)  # completions

    return Objective(loss_sums=loss_sums, normalizer=normalizer, token_nll=False)


class RLOOSource(RolloutSource):
    """GRPO's rollouts with RLOO's advantages: the reward penalized by the completion's KL to
    the reference, from the log-probs the round takes when it is sampled."""

    _kl_fn: Any = None  # compiled at the first round

    def _advantages(self, per_func: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # The weighted rewards now; the advantages need the round's log-probs (below).
        rewards = self.weighted_rewards(per_func)
        return rewards, np.zeros(len(rewards), np.float32), np.zeros(len(rewards), bool)

    def final_advantages(
        self,
        state: Any,
        placed: dict[str, jax.Array],
        trainer_logps: jax.Array,
        rewards: np.ndarray,
        equal: np.ndarray,
    ) -> tuple[np.ndarray, dict[str, float]]:
        settings, logs = self.settings, {}
        kl = np.zeros(len(rewards))
        if settings.task.beta > 0:
            per_row, total, tokens = self._kl(state, placed, trainer_logps)
            kl = np.asarray(per_row, np.float64).reshape(-1)  # batch order, as `rewards`
            logs["kl"] = float(total) / max(float(tokens), 1.0)
        clip = settings.task.reward_clip_range
        advantages, equal = rloo_advantages(
            rewards,
            kl,
            beta=settings.task.beta,
            num_generations=settings.task.num_generations,
            normalize=settings.task.normalize_advantages,
            clip_range=None if clip is None else (float(clip[0]), float(clip[1])),
        )
        shaped = advantages.reshape(settings.data.accumulation_steps, -1)
        local = {"advantages": self.local_rows(shaped, micro_axis=True)}
        placed["advantages"] = self.layout.to_global(local, micro_axis=True)["advantages"]
        return equal, logs

    def _kl(
        self, state: Any, placed: dict[str, jax.Array], trainer_logps: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(each completion's summed log pi_old - log pi_ref [A, M], their total, the tokens),
        the same on every process."""
        program, t = self.program, self.settings.task.temperature
        if self._kl_fn is None:
            graphdef = program.graphdef
            everywhere = NamedSharding(self.layout.mesh, PartitionSpec())

            def kl_rows(params, rest, ids, labels, old, images):
                task = nnx.merge(graphdef, params, rest)
                flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
                if images is not None:  # a vision prompt's image slots, per row
                    images = images.reshape(-1, *images.shape[2:])
                seen = dict(temperature=t, pixel_values=images)
                if task.reference is not None:
                    ref, mask = model_token_logps(task.reference, flat(ids), flat(labels), **seen)
                else:  # LoRA: the reference is the base, the policy without its adapters
                    with adapters_off(task.model) as base:
                        ref, mask = model_token_logps(base, flat(ids), flat(labels), **seen)
                mask = mask.astype(jnp.float32)
                per_token = (flat(old) - ref) * mask
                return per_token.sum(-1).reshape(ids.shape[:2]), per_token.sum(), mask.sum()

            self._kl_fn = jax.jit(kl_rows, out_shardings=(everywhere, everywhere, everywhere))
        return self._kl_fn(
            state.params,
            program.frozen_state(),
            placed["input_ids"],
            placed["labels"],
            trainer_logps,
            placed.get("pixel_values"),
        )


class RLOOTrainer(GRPOTrainer):
    """Online RL from reward functions by RLOO: GRPOTrainer's arguments and options (rewards,
    tools, environments, evaluation), RLOOArguments, and RLOO's advantages and objective (see
    the module docstring and docs/tasks.md "RLOO")."""

    arguments_class = RLOOArguments
    source_class = RLOOSource

    @staticmethod
    def task_objective(settings: RunSettings) -> Objective:
        return rloo_objective(settings)
