"""The weights of a data mixture: parsed once, checked with one-line errors.

`mixture_weights` is either one mapping `{name: weight}` (the same weights for the whole run)
or a list of stages `[[step, {name: weight}], ...]` starting at step 0, for annealing: from
each stage's step on, its weights hold. A source a stage leaves out has weight 0 in it.
Weights are >= 0 and need not sum to 1 (they are shares once divided by their sum).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from jaxtrain.errors import ArgumentError

__all__ = ["Stages", "check_mixture_names", "parse_mixture_weights"]

FIELD = "TrainingArguments.mixture_weights"

# ((first step, ((name, weight), ...)), ...): hashable, so a frozen section can hold it.
Stages = tuple[tuple[int, tuple[tuple[str, float], ...]], ...]


def _weights(value: Any, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, Mapping) or not value:
        raise ArgumentError(
            f"{where} must map source names to weights, e.g. {{web: 0.7, code: 0.3}}; "
            f"got {value!r}."
        )
    out = []
    for name, weight in value.items():
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"{where}: {name!r} is not a source name (a non-empty string).")
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ArgumentError(f"{where}[{name!r}]={weight!r} must be a number >= 0.")
        if not math.isfinite(weight) or weight < 0:
            raise ArgumentError(
                f"{where}[{name!r}]={weight} is negative or not finite; weights are >= 0 "
                "(0 leaves a source out)."
            )
        out.append((name, float(weight)))
    if not any(weight > 0 for _, weight in out):
        raise ArgumentError(
            f"{where}: every weight is 0; give at least one source a positive weight."
        )
    return tuple(out)


def parse_mixture_weights(value: Any, field: str = FIELD) -> Stages | None:
    """The stages of `mixture_weights` (None when it is None); ArgumentError naming the field,
    the value and the fix for anything else."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return ((0, _weights(value, field)),)
    if not isinstance(value, list | tuple) or not value:
        raise ArgumentError(
            f"{field} must be {{name: weight}} or a list of [step, {{name: weight}}] stages; "
            f"got {value!r}."
        )
    stages = []
    for i, entry in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(entry, list | tuple) or len(entry) != 2:
            raise ArgumentError(f"{where}={entry!r} must be a pair [step, {{name: weight}}].")
        step, weights = entry
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ArgumentError(f"{where}: the step {step!r} must be an integer >= 0.")
        if stages and step <= stages[-1][0]:
            raise ArgumentError(
                f"{where}: stage steps must increase; step {step} follows {stages[-1][0]}."
            )
        if not stages and step != 0:
            raise ArgumentError(
                f"{where}: the first stage starts at step 0 (the run's first step); got {step}."
            )
        stages.append((step, _weights(weights, where)))
    return tuple(stages)


def stage_names(stages: Stages) -> list[str]:
    """Every source name the stages mention, in order of first mention."""
    names: list[str] = []
    for _, weights in stages:
        names += [name for name, _ in weights if name not in names]
    return names


def check_mixture_names(stages: Stages, sources: Iterable[str], what: str) -> None:
    """The weights name exactly the sources of `what` (e.g. "dataset_train"): an unknown
    name, or a source with no weight in any stage, is a one-line ArgumentError."""
    sources = list(sources)
    named = stage_names(stages)
    unknown = [name for name in named if name not in sources]
    if unknown:
        raise ArgumentError(
            f"{FIELD} names {unknown}, which {what} does not have (its sources: {sources}); "
            "fix the name or add the source."
        )
    missing = [name for name in sources if name not in named]
    if missing:
        raise ArgumentError(
            f"{what} has source(s) {missing} that {FIELD} gives no weight; add them "
            "(a weight of 0 leaves a source out)."
        )
