"""Per-sequence log-probabilities of the preference losses, padded or packed.

A preference batch holds several sequences per unit (a pair's chosen and rejected; a KTO
example's completion and its mismatched KL completion). The losses read per-sequence sums:

- ``logps``: the sum of log p over the sequence's response tokens (labels != -100), and
  ``tokens`` their count (for length-normalised losses: IPO, SimPO, ORPO);
- with ``full``: the same over every token of the sequence but its first, prompt included
  (ORPO's NLL term, as TRL computes it);
- with ``entropy``: the sum of the policy's entropy over the response tokens.

Two layouts give the same sums (``tests/trainers/test_pair_packing.py``):

- padded: one sequence per row, side by side: ``{prefix}input_ids``/``{prefix}labels``/
  ``{prefix}attention_mask`` [N, T] for each side prefix ("" and "rejected_" for pairs);
  sequence s of side k is row s of side k, i.e. index k * N + s;
- packed (``packing=True``): ``input_ids``/``labels``/``segment_ids``/``positions``/
  ``sequence_index`` [R, L] rows holding many sequences, each isolated by its segment id and
  numbered from position 0; ``sequence_index`` says which sequence (k * N + s) each token
  belongs to, and ``pair_mask`` [N] which of the N unit slots hold a real unit. Sums are
  gathered from the tokens with a segment sum.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.models.attention import padding_segments
from jaxtrain.training.logps import (
    chunk_tokens_for,
    chunked_token_logps,
    chunks_logits,
    pair_mask,
    token_logps,
)

__all__ = [
    "KL_SIDES",
    "PAIR_SIDES",
    "SequenceLogps",
    "full_target_count",
    "is_packed",
    "preference_sums",
    "real_units",
    "response_token_count",
    "sequence_logps",
    "unit_count",
]

PAIR_SIDES = ("", "rejected_")  # chosen, rejected
KL_SIDES = ("", "KL_")  # KTO: the completion, the mismatched completion of the KL estimate


@dataclasses.dataclass(frozen=True)
class SequenceLogps:
    """Per-sequence sums, each [sides * N] (side k's sequences at k * N ... (k + 1) * N)."""

    logps: jax.Array
    tokens: jax.Array
    full_logps: jax.Array | None = None
    full_tokens: jax.Array | None = None
    entropy: jax.Array | None = None

    def side(self, name: str, k: int, n: int) -> jax.Array:
        """Field `name` of side k (of N units)."""
        return getattr(self, name)[k * n : (k + 1) * n]


def is_packed(batch: dict[str, jax.Array]) -> bool:
    return "sequence_index" in batch


def unit_count(batch: dict[str, jax.Array]) -> int:
    """N: the unit slots of a (micro-)batch (rows of a padded side, pair_mask of a packed one)."""
    return batch["pair_mask"].shape[-1] if is_packed(batch) else batch["labels"].shape[-2]


def real_units(batch: dict[str, jax.Array]) -> jax.Array:
    """[..., N] float: 1 for a unit slot that holds a real pair or example (not a filler)."""
    if is_packed(batch):
        return batch["pair_mask"].astype(jnp.float32)
    return pair_mask(batch["labels"]).astype(jnp.float32)


def preference_sums(
    reward_chosen: jax.Array,
    reward_rejected: jax.Array,
    chosen: jax.Array,
    rejected: jax.Array,
    real: jax.Array,
) -> dict[str, jax.Array]:
    """What every pair objective logs, as TRL does, summed over the real pairs: the implicit
    rewards (given without gradient), the pairs whose chosen reward wins, the policy's
    log-probs of each side. `real` [N] is 1 for a real pair, 0 for padding."""
    won = (reward_chosen > reward_rejected).astype(jnp.float32) * real
    stop = jax.lax.stop_gradient
    return {
        "tokens": real.sum(),
        "correct": won.sum(),
        "rewards/chosen_sum": (reward_chosen * real).sum(),
        "rewards/rejected_sum": (reward_rejected * real).sum(),
        "rewards/margins_sum": ((reward_chosen - reward_rejected) * real).sum(),
        "rewards/accuracies_sum": won.sum(),
        "logps/chosen_sum": (stop(chosen) * real).sum(),
        "logps/rejected_sum": (stop(rejected) * real).sum(),
    }


def _same_sequence_targets(real: jax.Array) -> jax.Array:
    """[..., T-1]: the token at t + 1 is a target of the sequence that holds token t (both
    real and of one segment). `real`: segment ids (packed) or the attention mask (padded)."""
    return (real[..., 1:] > 0) & (real[..., 1:] == real[..., :-1])


def full_target_count(batch: dict[str, jax.Array], side: int = 0) -> jax.Array:
    """Tokens of side `side`'s sequences of a (global) batch that are predicted from the
    sequence's own earlier tokens, prompt included: the count ORPO's NLL averages over."""
    if is_packed(batch):
        index = batch["sequence_index"][..., 1:]
        n = unit_count(batch)
        mine = (index >= side * n) & (index < (side + 1) * n)
        return (_same_sequence_targets(batch["segment_ids"]) & mine).sum().astype(jnp.float32)
    prefix = PAIR_SIDES[side]
    mask = batch[f"{prefix}attention_mask"]
    return _same_sequence_targets(mask).sum().astype(jnp.float32)


def response_token_count(batch: dict[str, jax.Array], side: int = 0) -> jax.Array:
    """Response (labelled) tokens of side `side`'s sequences of a (global) batch."""
    if is_packed(batch):
        index = batch["sequence_index"][..., 1:]
        n = unit_count(batch)
        mine = (index >= side * n) & (index < (side + 1) * n)
        return ((batch["labels"][..., 1:] != IGNORE_INDEX) & mine).sum().astype(jnp.float32)
    prefix = PAIR_SIDES[side]
    return (batch[f"{prefix}labels"][..., 1:] != IGNORE_INDEX).sum().astype(jnp.float32)


def _rows(batch: dict[str, jax.Array], sides: tuple[str, ...]) -> dict[str, Any]:
    """The batch as rows of tokens for one forward pass, with what segments them."""
    if is_packed(batch):
        return {
            "ids": batch["input_ids"],
            "labels": batch["labels"],
            "real": batch["segment_ids"],
            "model": {"positions": batch["positions"], "segment_ids": batch["segment_ids"]},
            "index": batch["sequence_index"],
            "count": len(sides) * unit_count(batch),
        }
    cat = lambda key: jnp.concatenate([batch[f"{p}{key}"] for p in sides])  # noqa: E731
    model = {}  # right-padded rows: causal attention never lets a real token see padding
    segments = padding_segments(cat("attention_mask"))  # only where they save attention
    if segments is not None:
        model["segment_ids"] = segments
    if "pixel_values" in batch:  # a vision prompt's images, seen by every side's sequence
        model["pixel_values"] = jnp.concatenate([batch["pixel_values"]] * len(sides))
    return {
        "ids": cat("input_ids"),
        "labels": cat("labels"),
        "real": cat("attention_mask"),
        "model": model,
        "index": None,
        "count": len(sides) * unit_count(batch),
    }


def _token_logps(model: Any, rows: dict[str, Any], targets: jax.Array, entropy: bool):
    """Per-token log-probs [R, T-1] of `targets` (and entropies), chunked at a large
    vocabulary as `logps.model_token_logps` is, with the packed rows' positions/segments."""
    ids = rows["ids"]
    if chunks_logits(model, ids.size):
        hidden = model.hidden_states(ids, **rows["model"])
        chunk = chunk_tokens_for(model.config.vocab_size)
        out = chunked_token_logps(
            hidden, model.output_projection(), targets, chunk_tokens=chunk, entropy=entropy
        )
    else:
        out = token_logps(model(ids, **rows["model"]), targets, entropy=entropy)
    return out[0], (out[2] if entropy else None)


def _per_sequence(x: jax.Array, rows: dict[str, Any]) -> jax.Array:
    """[R, T-1] token values -> [count] sums per sequence (the target token's sequence)."""
    if rows["index"] is None:
        return x.sum(-1)
    index = rows["index"][:, 1:].reshape(-1)
    return jax.ops.segment_sum(x.reshape(-1), index, num_segments=rows["count"])


def sequence_logps(
    model: Any,
    batch: dict[str, jax.Array],
    sides: tuple[str, ...] = PAIR_SIDES,
    *,
    full: bool = False,
    entropy: bool = False,
) -> SequenceLogps:
    """Per-sequence sums of `model`'s log-probs over a padded or packed batch (see the
    module docstring), from one forward pass over every side's sequences."""
    rows = _rows(batch, sides)
    labels = rows["labels"]
    response = labels[:, 1:] != IGNORE_INDEX
    if full:  # every token after a sequence's first is a target (the responses among them)
        whole = _same_sequence_targets(rows["real"])
        targets = jnp.where(whole, rows["ids"][:, 1:], IGNORE_INDEX)
        targets = jnp.concatenate([jnp.full_like(labels[:, :1], IGNORE_INDEX), targets], 1)
    else:
        targets = labels
    logp, ent = _token_logps(model, rows, targets, entropy)
    as_float = lambda m: m.astype(jnp.float32)  # noqa: E731
    out = {
        "logps": _per_sequence(jnp.where(response, logp, 0.0), rows),
        "tokens": _per_sequence(as_float(response), rows),
    }
    if full:
        out["full_logps"] = _per_sequence(logp, rows)
        out["full_tokens"] = _per_sequence(as_float(whole), rows)
    if entropy:
        out["entropy"] = _per_sequence(jnp.where(response, ent, 0.0), rows)
    return SequenceLogps(**out)
