"""The GRPO objective as pure functions: group advantages from rewards, and the policy
surrogate with a KL penalty for TRL 1.16's loss types (GRPO, BNPO, Dr. GRPO, DAPO, CISPO,
SAPO, LUSPO, VESPO).

Per completion token t, with the importance ratio r and the advantage A of its completion:

    clipped surrogate (grpo, bnpo, dr_grpo, dapo, luspo):
        loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
        (with `delta`, INTELLECT-2's two-sided clip: the first r capped at delta)
    cispo (MiniMax-M1): the ratio capped at epsilon_high and held constant, times log p:
        loss_t = -sg(min(r, epsilon_high)) A logp_t
    sapo (soft adaptive): a sigmoid gate instead of the clip, tau by the sign of A
        (tau_pos where A > 0, else tau_neg):
        loss_t = -(4 / tau) sigmoid(tau (r - 1)) A
    vespo: a smooth weight of the completion's ratio w (exp of its summed log-ratios),
        phi(w) = exp(lambda + k log w - lambda w), k and lambda by the sign of A, held
        constant, times log p: loss_t = -phi A logp_t
    plus beta kl_t, kl_t = exp(ref - logp) - (ref - logp) - 1 (the k3 estimator, >= 0),

times r when `kl_ratio_weight` (the default, as TRL's use_bias_correction_kl: the KL's
gradient is then the unbiased reverse-KL gradient also for reused, off-policy batches).

The ratio: `importance_sampling_level="token"` r_t = exp(logp_t - old_t); "sequence"
(GSPO) one ratio per completion, exp of the mean of logp - old over its tokens, given to
each of its tokens (clipped, capped or gated as one). `off_policy_mask_threshold` delta
(DeepSeek-V3.2's off-policy sequence mask) drops the policy term of a completion whose
advantage is negative and whose mean old - logp over its tokens exceeds delta.

The loss types differ in how loss_t is averaged (mask: the completion's tokens):

- grpo, sapo:   per completion, the mean over its tokens; then the mean over completions
- bnpo:         the mean over every token of the micro-batch; then the mean over micro-batches
- dr_grpo:      the sum over every token / (completions x max_completion_length)
- luspo:        per completion, the sum over its tokens; then the mean over completions
- dapo, cispo, vespo: the sum over every token / the completion tokens of the whole update

`grpo_loss` is the loss of one batch (what TRL computes for it with no accumulation);
`grpo_loss_sums` is the same as objective sums (jaxtrain/objective.py) over a micro-batch,
whose `loss_sum / grpo_normalizer(global batch)` is that loss for any accumulation.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "quiet_nan_warnings",
    "CLIPPED_LOSS_TYPES",
    "clip_metric_name",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_sums",
    "grpo_normalizer",
    "grpo_token_terms",
]

# The loss types of the clipped surrogate min(r A, clip(r) A); cispo and sapo have their own.
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


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
    with np.errstate(invalid="ignore", divide="ignore"), quiet_nan_warnings():
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


@contextlib.contextmanager
def quiet_nan_warnings() -> Iterator[None]:
    """numpy's "mean of empty slice" warnings off: an all-NaN group is handled (-> 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def clip_metric_name(loss_type: str) -> str | None:
    """The name TRL logs the share of clipped tokens under for `loss_type` (None: sapo, whose
    gate clips nothing)."""
    if loss_type in CLIPPED_LOSS_TYPES:
        return "clip_ratio"  # TRL's clip_ratio/region_mean
    return "cispo_clip_ratio" if loss_type == "cispo" else None  # vespo logs its weight


def grpo_token_terms(
    logps: jax.Array,
    old_logps: jax.Array | None,
    ref_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    loss_type: str = "dapo",
    beta: float,
    epsilon: float,
    epsilon_high: float,
    kl_ratio_weight: bool = True,
    importance_sampling_level: str = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    off_policy_mask_threshold: float | None = None,
    sampler_logps: jax.Array | None = None,
    sampler_weight: jax.Array | None = None,
    delta: float | None = None,
    vespo: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
) -> dict[str, jax.Array]:
    """Per-token terms: "loss" [B, T] (the policy term of `loss_type` + beta kl), "kl"
    [B, T] and, but for sapo, "clipped" (1 where the clip or cap is active: [B, T] per token,
    [B, 1] per completion at the sequence level). `old_logps` None: on-policy (old = logps,
    no gradient); `ref_logps` None: no KL (beta must then be 0). mask [B, T]: the completion
    tokens (the sequence-level ratio and the off-policy mask average over them).
    `sampler_weight` [B, T] (grpo_agreement.sampler_ratio): the policy term's weight for the
    sampler/trainer mismatch; the off-policy mask then measures the drift from
    `sampler_logps`, the sampler's own log-probs, as TRL does with its vLLM log-probs
    (vespo instead adds the weight's log to its sequence ratio). `delta`: the clipped losses'
    two-sided clip (INTELLECT-2: the unclipped ratio capped at delta). `vespo`: its (k_pos,
    lambda_pos, k_neg, lambda_neg)."""
    old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps
    mask = mask.astype(jnp.float32)
    adv = advantages[:, None]
    log_ratio = logps - old
    if importance_sampling_level == "sequence":  # GSPO: the completion's mean log-ratio
        tokens = jnp.maximum(mask.sum(-1, keepdims=True), 1.0)
        log_ratio = (log_ratio * mask).sum(-1, keepdims=True) / tokens
    elif importance_sampling_level != "token":
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}")
    ratio = jnp.exp(log_ratio)  # [B, T] or [B, 1]
    out = {}
    if loss_type in CLIPPED_LOSS_TYPES:
        clipped_ratio = jnp.clip(ratio, 1 - epsilon, 1 + epsilon_high)
        # Two-sided (delta): a negative advantage's ratio is capped too.
        first = ratio if delta is None else jnp.minimum(ratio, delta)
        policy = -jnp.minimum(first * adv, clipped_ratio * adv)
        low = (first < 1 - epsilon) & (adv < 0)
        out["clipped"] = low | ((first > 1 + epsilon_high) & (adv > 0))
    elif loss_type == "cispo":  # the capped ratio is a constant weight on log p's gradient
        weight = jax.lax.stop_gradient(jnp.minimum(ratio, epsilon_high))
        policy = -weight * adv * logps
        out["clipped"] = (ratio > epsilon_high) & (adv > 0)
    elif loss_type == "sapo":
        tau = jnp.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        policy = -jax.nn.sigmoid(tau * (ratio - 1)) * (4.0 / tau) * adv
    elif loss_type == "vespo":
        phi = vespo_weight(logps - old, adv, mask, sampler_weight, *vespo)
        policy = -phi * adv * logps
        out["phi"] = phi
        sampler_weight = None  # in the weight's ratio, not on the loss
    else:
        raise ValueError(f"unknown GRPO loss_type {loss_type!r}")
    if off_policy_mask_threshold is not None:
        sampled = old if sampler_logps is None else sampler_logps
        policy = policy * off_policy_keep(
            jax.lax.stop_gradient(logps), sampled, advantages, mask, off_policy_mask_threshold
        )
    loss = jnp.broadcast_to(policy, logps.shape)
    if sampler_weight is not None:  # after the mask, before the KL term: as TRL orders them
        loss = loss * sampler_weight
    kl = jnp.zeros_like(logps)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        gap = ref_logps - logps
        kl = jnp.exp(gap) - gap - 1
        if kl_ratio_weight:
            kl = kl * ratio
        loss = loss + beta * kl
    out = {k: v.astype(jnp.float32) for k, v in out.items()}
    return {"loss": loss, "kl": kl, **out}


def vespo_weight(
    log_ratio: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    sampler_weight: jax.Array | None,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> jax.Array:
    """VESPO's weight [B, 1] (a constant: no gradient): phi(w) = exp(lambda + k log w -
    lambda w), w the completion's ratio exp(sum of its tokens' log-ratios, each clipped to
    [-20, 20]; with a sampler correction, plus the sum of the log weights), log w clipped to
    [log 1e-8, 20]; k, lambda by the advantage's sign (A >= 0: the _pos ones), as TRL."""
    low = float(np.log(1e-8))
    log_w = (jnp.clip(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdims=True)
    if sampler_weight is not None:
        log_w = log_w + (jnp.clip(jnp.log(sampler_weight), low, 20.0) * mask).sum(-1, keepdims=True)
    log_w = jnp.clip(log_w, low, 20.0)
    positive = advantages >= 0
    k = jnp.where(positive, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(positive, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jax.lax.stop_gradient(jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0))


def off_policy_keep(
    logps: jax.Array,
    sampling_logps: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    threshold: float,
) -> jax.Array:
    """[B, 1]: 1 keeps a completion's policy term, 0 drops it: dropped when its advantage is
    negative and its mean sampling_logps - logps over its tokens (a KL estimate of how far
    the policy moved off the sampler; a NaN token counts 0) exceeds `threshold`."""
    drift = jnp.nan_to_num(sampling_logps - logps, nan=0.0) * mask
    mean = drift.sum(-1, keepdims=True) / jnp.maximum(mask.sum(-1, keepdims=True), 1.0)
    keep = (advantages[:, None] >= 0) | (mean <= threshold)
    return keep.astype(jnp.float32)


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
    **options: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, {"kl", and clip_metric_name(loss_type) if any}) of one batch: logps/old/ref/
    mask [B, T] over the completion tokens, advantages [B]; `options`: grpo_token_terms's
    (kl_ratio_weight, importance_sampling_level, sapo temperatures, off_policy_mask_threshold).
    kl is a mean over the masked tokens; the clip ratio over them, or over the completions at
    the sequence level (as TRL logs it)."""
    sums = grpo_loss_sums(
        logps, old_logps, ref_logps, advantages, mask,
        loss_type=loss_type, beta=beta, epsilon=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        max_completion_length=max_completion_length or mask.shape[1], **options,
    )  # fmt: skip
    batch = {"completion_tokens": mask.sum(), "rows": jnp.float32(mask.shape[0])}
    normalizer = _normalizer(loss_type, batch, micro_batches=1)
    metrics = {"kl": sums["token_kl_sum"] / jnp.maximum(sums["completion_tokens"], 1.0)}
    name = clip_metric_name(loss_type)
    if name is not None:
        metrics[name] = sums["clipped_sum"] / jnp.maximum(sums["clipped_count"], 1.0)
    return sums["loss_sum"] / normalizer, metrics


def grpo_loss_sums(
    logps: jax.Array,
    old_logps: jax.Array | None,
    ref_logps: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    loss_type: str,
    max_completion_length: int,
    **options: Any,
) -> dict[str, jax.Array]:
    """The loss sum of one micro-batch (its normalizer: `grpo_normalizer`), its completion
    tokens, their KL sum and, but for sapo, "clipped_sum" / "clipped_count" (clipped tokens
    of the completion tokens; clipped completions of the rows at the sequence level).
    `options`: grpo_token_terms's keywords."""
    terms = grpo_token_terms(
        logps, old_logps, ref_logps, advantages, mask, loss_type=loss_type, **options
    )
    mask = mask.astype(jnp.float32)
    masked = terms["loss"] * mask
    if loss_type in ("grpo", "sapo"):
        loss_sum = (masked.sum(-1) / jnp.maximum(mask.sum(-1), 1.0)).sum()
    elif loss_type == "luspo":  # each completion's sum, averaged over completions
        loss_sum = masked.sum()
    elif loss_type == "bnpo":  # a mean per micro-batch; the normalizer counts micro-batches
        loss_sum = masked.sum() / jnp.maximum(mask.sum(), 1.0)
    elif loss_type == "dr_grpo":
        loss_sum = masked.sum() / max_completion_length
    elif loss_type in ("dapo", "cispo", "vespo"):
        loss_sum = masked.sum()
    else:
        raise ValueError(f"unknown GRPO loss_type {loss_type!r}")
    kl = jax.lax.stop_gradient(terms["kl"]) * mask
    sums = {"loss_sum": loss_sum, "completion_tokens": mask.sum(), "token_kl_sum": kl.sum()}
    if "phi" in terms:  # vespo: its weight's mean over completions
        sums["phi_sum"] = terms["phi"].sum()
    if "clipped" in terms:
        clipped = terms["clipped"]
        if options.get("importance_sampling_level") == "sequence":  # TRL counts every row
            sums["clipped_sum"] = clipped.sum()
            sums["clipped_count"] = jnp.float32(clipped.shape[0])
        else:
            sums["clipped_sum"] = (clipped * mask).sum()
            sums["clipped_count"] = mask.sum()
    return sums


def _normalizer(loss_type: str, counts: dict[str, jax.Array], micro_batches: int) -> jax.Array:
    if loss_type in ("grpo", "dr_grpo", "sapo", "luspo"):
        return counts["rows"]
    if loss_type == "bnpo":
        return jnp.float32(micro_batches)
    return jnp.maximum(counts["completion_tokens"], 1.0)  # dapo, cispo, vespo


def grpo_normalizer(loss_type: str, completion_mask: jax.Array) -> jax.Array:
    """What a whole update's loss sums are divided by, from its completion mask [A, M, T]
    (A micro-batches of M completions): completions (grpo, dr_grpo, sapo, luspo),
    micro-batches (bnpo) or completion tokens (dapo, cispo, vespo)."""
    counts = {
        "rows": jnp.float32(completion_mask.shape[0] * completion_mask.shape[1]),
        "completion_tokens": completion_mask.astype(jnp.float32).sum(),
    }
    return _normalizer(loss_type, counts, micro_batches=completion_mask.shape[0])
