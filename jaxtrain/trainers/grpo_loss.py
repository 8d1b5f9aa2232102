"""The GRPO objective as pure functions: group advantages from rewards, and the clipped
surrogate with a KL penalty for the four loss types (GRPO, BNPO, Dr. GRPO, DAPO).

Per completion token t, with r = exp(logp - old_logp) and advantage A of its completion:

    loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t
    kl_t   = exp(ref - logp) - (ref - logp) - 1        (the k3 estimator, always >= 0)

times r when `kl_ratio_weight` (the default, as TRL's use_bias_correction_kl: the KL's
gradient is then the unbiased reverse-KL gradient also for reused, off-policy batches).

The loss types differ only in how loss_t is averaged (mask: the completion's tokens):

- grpo:    per completion, the mean over its tokens; then the mean over completions
- bnpo:    the mean over every token of the micro-batch; then the mean over micro-batches
- dr_grpo: the sum over every token / (completions x max_completion_length)
- dapo:    the sum over every token / the completion tokens of the whole update

`grpo_loss` is the loss of one batch (what TRL computes for it with no accumulation);
`grpo_loss_sums` is the same as objective sums (jaxtrain/objective.py) over a micro-batch,
whose `loss_sum / grpo_normalizer(global batch)` is that loss for any accumulation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "group_advantages",
    "grpo_loss",
    "grpo_loss_sums",
    "grpo_normalizer",
    "grpo_token_terms",
]


def group_advantages(
    rewards: np.ndarray, num_generations: int, scale_rewards: str = "group"
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages [N], the group's rewards are all equal [N] bool) from rewards [N] (NaN: a
    completion no reward function scored) laid out as consecutive groups of num_generations.

    A NaN reward is left out of its group's mean and std and gets advantage 0. The std is
    the sample std (Bessel); 1e-4 keeps a group of equal rewards finite (advantage 0).
    """
    rewards = np.asarray(rewards, np.float64)
    groups = rewards.reshape(-1, num_generations)
    with np.errstate(invalid="ignore", divide="ignore"), _quiet():
        mean = np.repeat(np.nanmean(groups, axis=1), num_generations)
        group_std = np.repeat(np.nanstd(groups, axis=1, ddof=1), num_generations)
        if scale_rewards == "batch":
            std = np.full_like(rewards, np.nanstd(rewards, ddof=1))
        else:  # "group" scales by it; "none" only reports it
            std = group_std
        advantages = rewards - mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    equal = np.isclose(np.nan_to_num(group_std, nan=0.0), 0.0)
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32), equal


class _quiet:
    """numpy's "mean of empty slice" warnings off: an all-NaN group is handled (-> 0)."""

    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore", RuntimeWarning)

    def __exit__(self, *exc: Any):
        self._w.__exit__(*exc)


def grpo_token_terms(
    logps: jax.Array,
    old_logps: jax.Array | None,
    ref_logps: jax.Array | None,
    advantages: jax.Array,
    *,
    beta: float,
    epsilon: float,
    epsilon_high: float,
    kl_ratio_weight: bool = True,
) -> dict[str, jax.Array]:
    """Per-token terms [B, T]: "loss" (clipped surrogate + beta kl), "kl", "clipped" (the
    clip is active: the ratio left [1 - epsilon, 1 + epsilon_high] on the side that the
    advantage pushes it towards). `old_logps` None: on-policy (old = logps, no gradient);
    `ref_logps` None: no KL (beta must then be 0)."""
    old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps
    adv = advantages[:, None]
    ratio = jnp.exp(logps - old)
    clipped_ratio = jnp.clip(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -jnp.minimum(ratio * adv, clipped_ratio * adv)
    clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    kl = jnp.zeros_like(logps)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        delta = ref_logps - logps
        kl = jnp.exp(delta) - delta - 1
        if kl_ratio_weight:
            kl = kl * ratio
        loss = loss + beta * kl
    return {"loss": loss, "kl": kl, "clipped": clipped.astype(jnp.float32)}


def grpo_loss(
    logps: jax.Array,
    old_logps: jax.Array | None,
    ref_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    loss_type: str,
    beta: float,
    epsilon: float,
    epsilon_high: float | None = None,
    max_completion_length: int | None = None,
    kl_ratio_weight: bool = True,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, {"kl", "clip_ratio"}) of one batch: logps/old/ref/mask [B, T] over the
    completion tokens, advantages [B]. kl and clip_ratio are means over the masked tokens."""
    sums = grpo_loss_sums(
        logps, old_logps, ref_logps, advantages, mask,
        loss_type=loss_type, beta=beta, epsilon=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        max_completion_length=max_completion_length or mask.shape[1],
        kl_ratio_weight=kl_ratio_weight,
    )  # fmt: skip
    batch = {"completion_tokens": mask.sum(), "rows": jnp.float32(mask.shape[0])}
    normalizer = _normalizer(loss_type, batch, micro_batches=1)
    tokens = jnp.maximum(sums["completion_tokens"], 1.0)
    return sums["loss_sum"] / normalizer, {
        "kl": sums["token_kl_sum"] / tokens,
        "clip_ratio": sums["token_clipped_sum"] / tokens,
    }


def grpo_loss_sums(
    logps: jax.Array,
    old_logps: jax.Array | None,
    ref_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    loss_type: str,
    beta: float,
    epsilon: float,
    epsilon_high: float,
    max_completion_length: int,
    kl_ratio_weight: bool = True,
) -> dict[str, jax.Array]:
    """The loss sum of one micro-batch (its normalizer: `grpo_normalizer`), its completion
    tokens and their sums of KL and clip ratio ("tokens" is the caller's)."""
    terms = grpo_token_terms(
        logps, old_logps, ref_logps, advantages,
        beta=beta, epsilon=epsilon, epsilon_high=epsilon_high, kl_ratio_weight=kl_ratio_weight,
    )  # fmt: skip
    mask = mask.astype(jnp.float32)
    masked = terms["loss"] * mask
    if loss_type == "grpo":
        loss_sum = (masked.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).sum()
    elif loss_type == "bnpo":  # a mean per micro-batch; the normalizer counts micro-batches
        loss_sum = masked.sum() / jnp.maximum(mask.sum(), 1.0)
    elif loss_type == "dr_grpo":
        loss_sum = masked.sum() / max_completion_length
    elif loss_type == "dapo":
        loss_sum = masked.sum()
    else:
        raise ValueError(f"unknown GRPO loss_type {loss_type!r}")
    kl = jax.lax.stop_gradient(terms["kl"]) * mask
    clipped = terms["clipped"] * mask
    return {
        "loss_sum": loss_sum,
        "completion_tokens": mask.sum(),
        "token_kl_sum": kl.sum(),
        "token_clipped_sum": clipped.sum(),
    }


def _normalizer(loss_type: str, counts: dict[str, jax.Array], micro_batches: int) -> jax.Array:
    if loss_type in ("grpo", "dr_grpo"):
        return counts["rows"]
    if loss_type == "bnpo":
        return jnp.float32(micro_batches)
    return jnp.maximum(counts["completion_tokens"], 1.0)  # dapo


def grpo_normalizer(loss_type: str, completion_mask: jax.Array) -> jax.Array:
    """What a whole update's loss sums are divided by, from its completion mask [A, M, T]
    (A micro-batches of M completions): completions (grpo, dr_grpo), micro-batches (bnpo)
    or completion tokens (dapo)."""
    counts = {
        "rows": jnp.float32(completion_mask.shape[0] * completion_mask.shape[1]),
        "completion_tokens": completion_mask.astype(jnp.float32).sum(),
    }
    return _normalizer(loss_type, counts, micro_batches=completion_mask.shape[0])
