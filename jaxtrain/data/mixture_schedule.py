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

The loader asks for a block of steps at a time (`plan`): one tight loop over the block's
slots, and the numpy arrays a step's assembly needs, instead of a call and its set-up per
step. A slot's choice depends on the float values of w_k * t - n_k, ties included, so the
loop computes exactly those (a closed form or a numpy iteration would round differently).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxtrain.config.mixture import Stages

__all__ = ["MixtureSchedule", "Plan"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """The schedule of steps [first, first + len(sources)): per step, the source of each
    slot, the slots of each source, the stage's counts after the step, and where each slot's
    row sits among the step's rows concatenated source by source."""

    first: int
    sources: np.ndarray  # [steps, slots] int32
    takes: list[list[int]]  # [steps][sources]
    counts: list[tuple[int, ...]]  # [steps]: counts after the step
    gather: np.ndarray  # [steps, slots]: slot i's row is concatenated rows[gather[i]]

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

    def stage_of(self, step: int) -> int:
        """The stage whose weights hold at `step` (the last one starting at or before it)."""
        return bisect.bisect_right(self.starts, step) - 1

    def assign(self, step: int, counts: Sequence[int], slots: int) -> tuple[list[int], list[int]]:
        """(the source of each of `slots` slots of `step`, the counts after them), from the
        slot counts of `step`'s stage before it (zeros at a stage's first step)."""
        n = list(counts)
        chosen = round_robin(self._lists[self.stage_of(step)], n, sum(n), slots)
        return chosen, n

    def plan(self, step: int, counts: Sequence[int], slots: int, steps: int) -> Plan:
        """The schedule of up to `steps` steps from `step` (fewer: it ends with the stage),
        from the stage's counts before `step` (counts_at_start)."""
        stage = self.stage_of(step)
        if stage + 1 < len(self.starts):
            steps = min(steps, self.starts[stage + 1] - step)
        n = list(counts)
        flat = round_robin(self._lists[stage], n, sum(n), steps * slots)
        sources = np.asarray(flat, np.int32).reshape(steps, slots)
        k = len(self.names)
        cells = (np.arange(steps)[:, None] * k + sources).reshape(-1)
        per_step = np.bincount(cells, minlength=steps * k).reshape(steps, k)
        after = np.asarray(counts, np.int64) + np.cumsum(per_step, axis=0)
        # Rows arrive source by source (a stable sort of the slots by source); slot i takes
        # the row at its place in that order.
        order = np.argsort(sources, axis=1, kind="stable")
        gather = np.argsort(order, axis=1, kind="stable")
        return Plan(
            first=step,
            sources=sources,
            takes=per_step.tolist(),
            counts=[tuple(row) for row in after.tolist()],
            gather=gather,
        )

    def counts_at_start(self, step: int, previous: Sequence[int]) -> list[int]:
        """The counts to assign `step` from: `previous` (after step - 1), or zeros when
        `step` opens a new stage."""
        if step == 0 or self.stage_of(step) != self.stage_of(step - 1):
            return [0] * len(self.names)
        return list(previous)
