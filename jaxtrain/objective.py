"""The objective contract: what a loss function returns, and how each key is logged.

An objective is `loss_sums(model, batch, rng) -> dict of scalar sums` over one micro-batch
(`Objective.loss_sums` of training/program.py: a task's, or the causal LM loss; a Trainer
subclass may state it as `compute_loss_sums`). Sums, not means, so that
gradient accumulation, data parallelism and logging windows all weight every unit alike:

  loss_sum   required  the loss summed over the batch's units (tokens for a causal LM, pairs
                       for a preference loss); the update minimises loss_sum / normalizer
  tokens     required  how many units loss_sum sums over; the Objective's `normalizer` should
                       count the same units (it does for the default causal LM loss)
  correct    optional  units predicted right; logged as `accuracy`
  any other  optional  another sum over the same units (a z-loss, a DPO margin, a KL term)
  X_count    optional  beside X_sum: what X_sum is averaged over instead of `tokens` (GRPO's KL
                       and clip ratio are token means while its loss unit is the completion)

The one rule for logs: every value is summed over the logging window (or the whole eval
set) and divided by the summed `tokens` (or by its own summed `X_count`, and not logged when
that is 0: a mixture source with weight 0 has no loss), so each is a per-unit mean weighted
exactly like the loss. It is logged under its own name with a trailing `_sum` dropped (`z_loss_sum` ->
`z_loss`, `rewards/margins_sum` -> `rewards/margins`), `correct` as `accuracy`, and under
`eval/` in evaluation. Nothing an objective returns is dropped. `perplexity` = exp(loss) is
logged beside the loss only when the loss is a mean negative log-likelihood per token
(`Objective.token_nll`: the causal LM and SFT losses); the exponential of a preference,
classification or distillation loss is not a perplexity, so those trainers log none.
The step itself adds `grad_norm`, `learning_rate` and `nonfinite`, so an objective may not
return those names. A difference of two logged means is not a sum: an objective declares it
(`Objective.differences`, e.g. KTO's `rewards/margins` = `rewards/chosen` - `rewards/rejected`
over unpaired examples, as TRL logs it), and it is logged whenever both means are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

import jax

from jaxtrain.errors import ObjectiveError

REQUIRED_KEYS = ("loss_sum", "tokens")
KNOWN_KEYS = (*REQUIRED_KEYS, "correct")
# Keys the train step adds to the objective's sums; an objective returning them would be
# overwritten silently, so they are refused.
# Values of the state after a step, logged as the logging window's last (not sums).
STATE_KEYS = ("sparsity",)
STEP_KEYS = ("grad_norm", "learning_rate", "nonfinite", *STATE_KEYS)
SUM_SUFFIX = "_sum"
COUNT_SUFFIX = "_count"
# Names the logs already use for something else: an extra sum may not be logged as one.
RESERVED_LOG_NAMES = frozenset(
    {"step", "epoch", "loss", "perplexity", "accuracy", "batches", *STEP_KEYS}
)


class LossSums(TypedDict):
    """The required part of an objective's result; any further key is an extra sum."""

    loss_sum: jax.Array
    tokens: jax.Array


# (model, batch, rng) -> LossSums (plus extra sums), all scalars, summed over the batch.
Objective = Callable[[Any, dict[str, jax.Array], jax.Array], Mapping[str, jax.Array]]


def check_loss_sums(sums: Any, where: str = "compute_loss_sums") -> dict[str, jax.Array]:
    """The objective's result, checked when the step is traced (once, not per step).

    Raises ObjectiveError naming the missing or malformed key.
    """
    if not isinstance(sums, Mapping):
        raise ObjectiveError(
            f"{where} must return a dict of scalar sums with at least {list(REQUIRED_KEYS)}; "
            f"it returned {type(sums).__name__}."
        )
    missing = [key for key in REQUIRED_KEYS if key not in sums]
    if missing:
        raise ObjectiveError(
            f"{where} returned {sorted(sums)} without {missing}: an objective returns sums "
            "over the batch with 'loss_sum' (the summed loss) and 'tokens' (how many units "
            "it sums over). See jaxtrain/objective.py."
        )
    clashes = [key for key in STEP_KEYS if key in sums]
    if clashes:
        raise ObjectiveError(
            f"{where} returned {clashes}: the train step sets these itself; rename the key(s)."
        )
    for key in sums:
        base = key[: -len(COUNT_SUFFIX)] if key.endswith(COUNT_SUFFIX) else None
        if base is not None and base + SUM_SUFFIX not in sums:
            raise ObjectiveError(
                f"{where} returned {key!r} without {base + SUM_SUFFIX!r}: a count is what that "
                "sum is averaged over; return both, or neither."
            )
    for key, value in sums.items():
        if key.endswith(COUNT_SUFFIX):
            pass
        elif key not in KNOWN_KEYS and log_name(key) in RESERVED_LOG_NAMES | {"tokens"}:
            raise ObjectiveError(
                f"{where} returned {key!r}, which would be logged as {log_name(key)!r}, a "
                "name the logs already use; rename the key."
            )
        shape = getattr(value, "shape", None)
        if shape is None or tuple(shape) != ():
            raise ObjectiveError(
                f"{where} returned {key!r} with shape {shape}: every value must be a scalar "
                "sum over the batch (use .sum())."
            )
    return dict(sums)


def log_name(key: str) -> str:
    """The name an objective's key is logged under (without the eval/ prefix)."""
    if key == "correct":
        return "accuracy"
    if key.endswith(SUM_SUFFIX):
        return key[: -len(SUM_SUFFIX)]
    return key


# (logged name, minuend, subtrahend): a difference of two logged means (see above).
Difference = tuple[str, str, str]


def summarize_sums(
    totals: Mapping[str, float],
    prefix: str = "",
    *,
    perplexity: bool = True,
    differences: Sequence[Difference] = (),
) -> dict[str, float]:
    """Log values of sums accumulated over a logging window or an eval set (see above);
    `perplexity`: the loss is a per-token NLL, so exp(loss) is logged too; `differences`:
    each (name, a, b) logs a - b of the logged means a and b when both are logged."""
    tokens = float(totals.get("tokens", 0.0))
    per_unit = max(tokens, 1.0)
    loss = float(totals["loss_sum"]) / per_unit
    logs = {f"{prefix}loss": loss}
    if perplexity:
        logs[f"{prefix}perplexity"] = math.exp(min(loss, 80.0))
    for key, value in totals.items():
        if key in REQUIRED_KEYS or key in STEP_KEYS or key.endswith(COUNT_SUFFIX):
            continue
        count = key[: -len(SUM_SUFFIX)] + COUNT_SUFFIX if key.endswith(SUM_SUFFIX) else None
        if count in totals:  # averaged over its own count; nothing to average: not logged
            if float(totals[count]) > 0:
                logs[prefix + log_name(key)] = float(value) / float(totals[count])
        else:
            logs[prefix + log_name(key)] = float(value) / per_unit  # per unit, like the loss
    for name, a, b in differences:
        if prefix + a in logs and prefix + b in logs:
            logs[prefix + name] = logs[prefix + a] - logs[prefix + b]
    return logs
