"""How far the sampler's log-probs are from the trainer's, and the importance weights that
correct for it (TRL 1.16's vllm_importance_sampling_*, GRPOArguments.sampler_correction).

The engine scores every token it draws (log-probs after the temperature, as the trainer
scores it). When a round is generated the trainer scores the same tokens with the same
parameters; the difference is the sampler/trainer mismatch: float rounding of other kernels
here, and in general a lower-precision or stale sampler. It is logged for every round
(`sampling/sampling_logp_difference/mean|max`), and with a correction each completion token's
loss is weighted by exp(trainer - sampler) (`sampling/importance_sampling_ratio/min|mean|max`).
Pure functions of arrays [B, T] over completion tokens (`mask`), jitted by the caller.

A mixture-of-experts policy's sampler also records the experts it sent each token to; the
trainer's own choice for the same tokens is compared with it (`routing_agreement`): the
share of (token, sparse layer) pairs routed to the same set of experts, on average and in the
layer that agrees least (`sampling/routing_agreement/mean|min`). GRPOArguments.routing_replay
makes the loss use the sampler's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtrain.data.collate import IGNORE_INDEX

__all__ = ["agreement", "round_agreement", "routing_agreement", "sampler_ratio"]


def round_agreement(
    trainer_logps: jax.Array,
    sampler_logps: jax.Array,
    labels: jax.Array,
    mode: str,
    low: float | None,
    high: float | None,
) -> tuple[jax.Array | None, dict[str, jax.Array]]:
    """A round's correction weights (shaped like `trainer_logps`; None for mode "none") and
    its logged agreement, over its scored completion tokens. logps [..., T - 1] are the
    log-probs of the tokens of rows `labels` [..., T] (IGNORE_INDEX: not a scored token)."""
    flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
    mask = flat(labels[..., 1:] != IGNORE_INDEX)
    trainer, sampler = flat(trainer_logps), flat(sampler_logps)
    weight = None if mode == "none" else sampler_ratio(trainer, sampler, mask, mode, low, high)
    logs = agreement(trainer, sampler, mask, weight, per_sequence=mode.startswith("sequence"))
    return (None if weight is None else weight.reshape(trainer_logps.shape)), logs


def sampler_ratio(
    trainer_logps: jax.Array,
    sampler_logps: jax.Array,
    mask: jax.Array,
    mode: str,
    low: float | None,
    high: float | None,
) -> jax.Array:
    """[B, T] weights of the completion tokens' losses: exp(trainer - sampler) per token, or
    per completion (the sum over its tokens, the same for each of them) for "sequence_*";
    clipped to [low, high] ("*_truncate") or zeroed outside it ("*_mask"); a bound of None
    is no bound. Positions outside `mask` get 1."""
    diff = jnp.where(mask, trainer_logps - sampler_logps, 0.0)
    level, constraint = mode.split("_")
    if level == "sequence":
        diff = jnp.broadcast_to(diff.sum(-1, keepdims=True), diff.shape)
    elif level != "token":
        raise ValueError(f"unknown sampler correction {mode!r}")
    ratio = jnp.exp(diff)
    if constraint == "truncate":
        return jnp.clip(ratio, low, high)
    if constraint != "mask":
        raise ValueError(f"unknown sampler correction {mode!r}")
    outside = jnp.zeros(ratio.shape, bool)
    if low is not None:
        outside |= ratio < low
    if high is not None:
        outside |= ratio > high
    return jnp.where(outside, 0.0, ratio)


def agreement(
    trainer_logps: jax.Array,
    sampler_logps: jax.Array,
    mask: jax.Array,
    ratio: jax.Array | None = None,
    per_sequence: bool = False,
) -> dict[str, jax.Array]:
    """The logged scalars: mean and max |trainer - sampler| over the completion tokens, and
    with `ratio` its min, mean and max over them (over the completions, one value each, when
    `per_sequence`), as TRL logs them. No token at all: 0."""
    tokens = mask.sum()
    any_token = tokens > 0
    delta = jnp.abs(trainer_logps - sampler_logps)
    out = {
        "sampling/sampling_logp_difference/mean": jnp.where(mask, delta, 0.0).sum()
        / jnp.maximum(tokens, 1),
        "sampling/sampling_logp_difference/max": jnp.where(
            any_token, jnp.where(mask, delta, -jnp.inf).max(), 0.0
        ),
    }
    if ratio is not None:
        if per_sequence:  # one value per completion (the first column carries it)
            values, counted = ratio[:, 0], jnp.ones(ratio.shape[0], bool)
        else:
            values, counted = ratio, mask
        n = counted.sum()
        some = n > 0
        name = "sampling/importance_sampling_ratio/"
        out[name + "min"] = jnp.where(some, jnp.where(counted, values, jnp.inf).min(), 0.0)
        out[name + "mean"] = jnp.where(counted, values, 0.0).sum() / jnp.maximum(n, 1)
        out[name + "max"] = jnp.where(some, jnp.where(counted, values, -jnp.inf).max(), 0.0)
    return out


def routing_agreement(trainer: jax.Array, sampler: jax.Array) -> dict[str, jax.Array]:
    """The logged routing agreement of experts [B, S, T, k] chosen by the trainer and by the
    sampler (-1: a token the sampler did not run, left out): a token agrees in a layer when
    both chose the same k experts, in any order. No token recorded: 1."""
    recorded = jnp.all(sampler >= 0, axis=-1)  # [B, S, T]
    same = jnp.all(jnp.sort(trainer, -1) == jnp.sort(sampler.astype(trainer.dtype), -1), -1)

    def share(axes: tuple[int, ...] | None) -> jax.Array:
        counted = recorded.sum(axes)
        return jnp.where(counted > 0, (same & recorded).sum(axes) / jnp.maximum(counted, 1), 1.0)

    return {
        "sampling/routing_agreement/mean": share(None),
        "sampling/routing_agreement/min": share((0, 2)).min(),
    }
