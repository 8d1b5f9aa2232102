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

The loader asks for a block of steps at a time (`plan`). A slot's choice depends on the
float values of w_k * t - n_k, ties included, so nothing may round differently from the rule.
Weights of small denominators repeat: once every count equals its share exactly (t = P,
w_k * P == n_k), the slots after are, up to rounding, those from the start again. So a
stage's first P slots are a guess for any block, which numpy checks against the rule in one
pass (`confirmed`: the rule's argmax at every slot, from the counts the guess implies); the
block keeps the confirmed slots and a plain loop makes the rest. Weights that do not repeat
within PERIOD_LIMIT slots always take the loop.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxtrain.config.mixture import Stages

__all__ = ["MixtureSchedule", "Plan"]

# Slots a stage's repeating pattern is looked for in (once per stage).
PERIOD_LIMIT = 4096


@dataclasses.dataclass(frozen=True)
class Plan:
    """The schedule of steps [first, first + len(sources)): per step, the source of each
    slot, the slots of each source and the stage's counts after the step."""

    first: int
    sources: np.ndarray  # [steps, slots] int32
    takes: list[list[int]]  # [steps][sources]
    counts: list[tuple[int, ...]]  # [steps]: counts after the step

    def __contains__(self, step: int) -> bool:
        return self.first <= step < self.first + len(self.counts)


def round_robin(w: Sequence[float], n: list[int], done: int, count: int) -> list[int]:
    """The sources of `count` slots after the `done` slots of a stage whose counts are `n`
    (updated in place). The products w_k * t come from numpy (the same IEEE products as
    Python's); the argmax is a plain loop over Python floats, the fastest way over a handful
    of sources, and `>` keeps the first source of the largest deficit on ties."""
    t = np.arange(done + 1, done + count + 1, dtype=np.float64)
    targets = (t[:, None] * np.asarray(w, np.float64)[None, :]).tolist()
    rest = range(1, len(n))
    chosen = []
    append = chosen.append
    for row in targets:
        best, top = 0, row[0] - n[0]
        for k in rest:
            deficit = row[k] - n[k]
            if deficit > top:
                best, top = k, deficit
        n[best] += 1
        append(best)
    return chosen


def confirmed(w: Sequence[float], n: Sequence[int], done: int, guess: np.ndarray) -> int:
    """How many of the slots `guess` (after the `done` slots of a stage whose counts are
    `n`) the rule picks: the index of the first slot it picks differently, or len(guess).
    The same float products and differences as round_robin; argmax keeps the first of equal
    deficits, as its `>` does."""
    m, k = len(guess), len(n)
    picked = np.zeros((m, k), np.int64)
    picked[np.arange(m), guess] = 1
    before = np.cumsum(picked, axis=0) - picked + np.asarray(n, np.int64)
    t = np.arange(done + 1, done + m + 1, dtype=np.float64)
    deficits = t[:, None] * np.asarray(w, np.float64)[None, :] - before
    wrong = np.flatnonzero(deficits.argmax(axis=1) != guess)
    return int(wrong[0]) if len(wrong) else m


def repeating(w: Sequence[float]) -> np.ndarray | None:
    """A stage's first P slots, P the first slot count at which every count is exactly its
    share (w_k * P == n_k): the rule's state of slot 0 again; None if none within PERIOD_LIMIT."""
    chosen = np.asarray(round_robin(w, [0] * len(w), 0, PERIOD_LIMIT), np.int64)
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[chosen], axis=0)
    t = np.arange(1, PERIOD_LIMIT + 1, dtype=np.float64)
    exact = np.flatnonzero((t[:, None] * np.asarray(w, np.float64)[None, :] == counts).all(axis=1))
    return chosen[: exact[0] + 1] if len(exact) else None


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
        self._lists = [row.tolist() for row in self.weights]
        self._patterns: dict[int, np.ndarray | None] = {}  # stage: repeating(...)

    def stage_of(self, step: int) -> int:
        """The stage whose weights hold at `step` (the last one starting at or before it)."""
        return bisect.bisect_right(self.starts, step) - 1

    def plan(self, step: int, counts: Sequence[int], slots: int, steps: int) -> Plan:
        """The schedule of up to `steps` steps from `step` (fewer: it ends with the stage),
        from the stage's counts before `step` (counts_at_start)."""
        stage = self.stage_of(step)
        if stage + 1 < len(self.starts):
            steps = min(steps, self.starts[stage + 1] - step)
        sources = self._slots(stage, counts, steps * slots).reshape(steps, slots)
        k = len(self.names)
        cells = (np.arange(steps)[:, None] * k + sources).reshape(-1)
        per_step = np.bincount(cells, minlength=steps * k).reshape(steps, k)
        after = np.asarray(counts, np.int64) + np.cumsum(per_step, axis=0)
        return Plan(step, sources, per_step.tolist(), [tuple(row) for row in after.tolist()])

    def _slots(self, stage: int, counts: Sequence[int], count: int) -> np.ndarray:
        """The sources of the next `count` slots of `stage` from its `counts`: the stage's
        repeating pattern where the rule confirms it, the loop from the first slot it does
        not."""
        w, n = self._lists[stage], list(counts)
        done = sum(n)
        if stage not in self._patterns:
            self._patterns[stage] = repeating(w)
        pattern = self._patterns[stage]
        good = np.zeros(0, np.int32)
        if pattern is not None:
            guess = pattern[np.arange(done, done + count) % len(pattern)]
            good = guess[: confirmed(w, n, done, guess)].astype(np.int32)
            if len(good) == count:
                return good
            n = (np.asarray(n) + np.bincount(good, minlength=len(n))).tolist()
        rest = round_robin(w, n, done + len(good), count - len(good))
        return np.concatenate([good, np.asarray(rest, np.int32)])

    def counts_at_start(self, step: int, previous: Sequence[int]) -> list[int]:
        """The counts to assign `step` from: `previous` (after step - 1), or zeros when
        `step` opens a new stage."""
        if step == 0 or self.stage_of(step) != self.stage_of(step - 1):
            return [0] * len(self.names)
        return list(previous)
