"""The mixture's schedule worked out a block of steps at a time (MixtureSchedule.plan) is the
per-slot weighted round-robin it replaced, slot for slot: exact resume depends on it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxtrain import TrainingArguments
from jaxtrain.data import build_mixture_loader
from jaxtrain.data.mixture_schedule import MixtureSchedule, confirmed


def reference(schedule: MixtureSchedule, steps: int, slots: int) -> list[list[int]]:
    """The rule as it was written before plan(): per step, from the stage's counts, each slot
    to max over sources of (w_k * t - n_k, -k) with Python floats."""
    out, counts = [], None
    for step in range(steps):
        stage = schedule.stage_of(step)
        if step == 0 or stage != schedule.stage_of(step - 1):
            counts = [0] * len(schedule.names)
        w = schedule.weights[stage].tolist()
        t = sum(counts)
        chosen = []
        for _ in range(slots):
            t += 1
            best = max(range(len(w)), key=lambda k: (w[k] * t - counts[k], -k))
            counts[best] += 1
            chosen.append(best)
        out.append(chosen)
    return out


RNG = np.random.default_rng(0)
WEIGHTINGS = [
    ((0, (("a", 0.5), ("b", 0.3), ("c", 0.2))),),
    ((0, (("a", 1.0), ("b", 1.0), ("c", 1.0))),),  # three-way ties every third slot
    ((0, (("a", 0.7), ("b", 0.3))),),
    ((0, (("a", 2.0), ("b", 1.0), ("c", 0.0))),),
    ((0, tuple((n, float(w)) for n, w in zip("abcde", RNG.dirichlet(np.ones(5))))),),
    (  # stages, one of them shorter than a plan block
        (0, (("a", 0.1), ("b", 0.6), ("c", 0.3))),
        (37, (("a", 0.0), ("b", 1.0), ("c", 0.0))),
        (41, (("a", 0.25), ("b", 0.25), ("c", 0.5))),
        (150, (("a", 0.9), ("b", 0.05), ("c", 0.05))),
    ),
]


@pytest.mark.parametrize("stages", WEIGHTINGS)
@pytest.mark.parametrize("slots,block", [(16, 64), (6, 7), (1, 1)])
def test_planned_blocks_are_the_per_slot_rule(stages, slots, block):
    names = sorted({name for _, named in stages for name, _ in named})
    schedule = MixtureSchedule(names, stages)
    steps = 300
    want = reference(schedule, steps, slots)
    counts, step = [0] * len(names), 0
    while step < steps:
        counts = schedule.counts_at_start(step, counts)
        plan = schedule.plan(step, counts, slots, min(block, steps - step))
        for i in range(len(plan.counts)):
            s = plan.first + i
            got = plan.sources[i].tolist()
            assert got == want[s], s
            assert plan.takes[i] == [got.count(k) for k in range(len(names))], s
        counts, step = list(plan.counts[-1]), plan.first + len(plan.counts)
        assert sum(counts) > 0
    # The counts after the last step are the reference's for its stage.
    stage_start = schedule.starts[schedule.stage_of(steps - 1)]
    flat = [k for chosen in want[stage_start:] for k in chosen]
    assert list(counts) == [flat.count(k) for k in range(len(names))]


def test_the_loader_takes_the_planned_sources_across_blocks_and_a_resume():
    """Batches across plan blocks and stages carry the reference's sources, and a run
    resumed mid-block continues them."""
    stages = [[0, {"a": 0.5, "b": 0.3, "c": 0.2}], [70, {"a": 0.2, "b": 0.2, "c": 0.6}]]
    settings = TrainingArguments(total_batch_size=8, gradient_accumulation_steps=2,
                                 max_sequence_length=4, max_steps=1000, progress_bar="none",
                                 mixture_weights=stages)  # fmt: skip
    sources = {n: [{"input_ids": [b + i % 50] * 4} for i in range(30)] for n, b in
               (("a", 1), ("b", 100), ("c", 200))}  # fmt: skip
    loader = build_mixture_loader(settings, sources)
    want = reference(loader.schedule, 160, 8)
    it = loader.batches()
    got = [next(it)["source_ids"].reshape(-1).tolist() for _ in range(100)]
    assert got == want[:100]
    saved = json.loads(json.dumps(loader.data_state(95)))
    fresh = build_mixture_loader(settings, sources)
    it = fresh.batches(start_step=fresh.check_data_state(saved))
    assert [next(it)["source_ids"].reshape(-1).tolist() for _ in range(65)] == want[95:160]


def test_a_pattern_the_rule_does_not_confirm_is_used_only_as_far_as_it_holds():
    """0.5/0.3/0.2 repeats every 10 slots; a guess wrong from slot 37 on is cut there, and
    a wrong pattern (as rounding could make one) still gives the rule's slots."""
    stages = ((0, (("a", 0.5), ("b", 0.3), ("c", 0.2))),)
    schedule = MixtureSchedule(["a", "b", "c"], stages)
    want = [k for step in reference(schedule, 40, 16) for k in step]
    guess = np.asarray(want[100:200])
    before = [want[:100].count(k) for k in range(3)]
    assert confirmed(schedule.weights[0].tolist(), before, 100, guess) == 100
    guess[37] = (guess[37] + 1) % 3
    assert confirmed(schedule.weights[0].tolist(), before, 100, guess) == 37
    schedule.plan(0, [0, 0, 0], 16, 1)  # finds the stage's pattern
    assert len(schedule._patterns[0]) == 10
    schedule._patterns[0] = np.roll(schedule._patterns[0], 1)
    counts = [want[:48].count(k) for k in range(3)]
    plan = schedule.plan(3, counts, 16, 37)
    assert plan.sources.reshape(-1).tolist() == want[48 : 48 + 37 * 16]
