"""Which source fills each row of a mixture's batch: a deterministic schedule by weight.

Every step has the same number of slots (a slot is one row on every process). Within a stage
of constant weights w (normalised to sum 1), slot t of the stage (counted from the stage's
first step) goes to the source furthest behind its target share:

    k(t) = argmax_k  w_k * (t + 1) - n_k(t)      (ties: the source listed first)

where n_k(t) counts the slots source k got before t. This is smooth weighted round-robin:
after any number of slots every source is within one slot of its exact share (so its share
of a step of S slots is off by less than 1/S), sources interleave instead of arriving in
runs, and a weight of 0 is never chosen. Random sampling by weight (Levanter, OLMo, Grain's
IterDataset sampling) is off by about sqrt(t * w * (1 - w)) slots instead, and needs a
random key per slot to resume.

The schedule is a pure function of the weights and the slot counts of the current stage,
which a resume restores from the checkpoint; a stage boundary starts the counts again.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from jaxtrain.config.mixture import Stages

__all__ = ["MixtureSchedule"]


class MixtureSchedule:
    """The stages of a mixture over the sources `names` (config/mixture.py's Stages)."""

    def __init__(self, names: Sequence[str], stages: Stages):
        self.names = tuple(names)
        self.starts = [start for start, _ in stages]
        weights = np.zeros((len(stages), len(self.names)), np.float64)
        for i, (_, named) in enumerate(stages):
            for name, weight in named:
                weights[i, self.names.index(name)] = weight
        self.weights = weights / weights.sum(axis=1, keepdims=True)

    def stage_of(self, step: int) -> int:
        """The stage whose weights hold at `step` (the last one starting at or before it)."""
        return bisect.bisect_right(self.starts, step) - 1

    def assign(self, step: int, counts: Sequence[int], slots: int) -> tuple[list[int], list[int]]:
        """(the source of each of `slots` slots of `step`, the counts after them), from the
        slot counts of `step`'s stage before it (zeros at a stage's first step)."""
        w = self.weights[self.stage_of(step)].tolist()
        n = list(counts)
        t = sum(n)
        order = range(len(w))
        chosen = []
        for _ in range(slots):
            t += 1
            # Python floats over a handful of sources: faster than numpy per slot.
            best = max(order, key=lambda k: (w[k] * t - n[k], -k))
            n[best] += 1
            chosen.append(best)
        return chosen, n

    def counts_at_start(self, step: int, previous: Sequence[int]) -> list[int]:
        """The counts to assign `step` from: `previous` (after step - 1), or zeros when
        `step` opens a new stage."""
        if step == 0 or self.stage_of(step) != self.stage_of(step - 1):
            return [0] * len(self.names)
        return list(previous)
