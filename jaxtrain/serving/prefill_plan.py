"""How many tokens of each waiting prompt the next prefill call writes.

A prefill call is [rows, width]: rows a bucket of the prompts it takes, width a bucket (x4
apart) of the longest piece it takes, and rows x width within the engine's `prefill_tokens`.
Every padded position costs what a real one does, so taking each prompt whole is not always
cheapest: 32 prompts of 22 tokens fill 8 rows of 64 per call (four calls, two thirds of them
padding), where pieces of at most 16 tokens fill 32 rows of 16 (two calls, a third padding).
`prefill_cap` picks that cap on each piece: the one whose plan for every waiting prompt costs
least under `PrefillCosts`, the whole prompt unless another saves a tenth. The plan depends on
the waiting prompts only, never on timings, so a run's calls are the same each time it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtrain.serving.steps import PREFILL_GROWTH, SMALLEST_PREFILL, bucket, buckets, chunk_tokens

__all__ = ["PrefillCosts", "PrefillPlan", "prefill_cap", "prefill_costs", "rows_that_fit"]


@dataclass(frozen=True)
class PrefillCosts:
    """A prefill call's time, in padded tokens' worth: `call` + rows x (width + `row`)."""

    call: float  # what any call costs: the weights read once, the host's work
    row: float  # what each row adds beyond its tokens: its pages gathered, its sampling


# SmolLM2-135M on this 2-core CPU (session 45, one engine's prefill calls timed alone, median of
# 5): 1 x 16 tokens 86 ms, 32 x 16 1,281 ms, 8 x 64 1,143 ms, 1 x 512 1,017 ms; a least-squares
# fit gives ~47 ms a call, 1.9 ms a padded token and 8.5 ms a row.
CPU_PREFILL_COSTS = PrefillCosts(call=24, row=4)
# Not measured on a GPU or TPU: a call under a few hundred tokens reads the weights more than
# it computes, so a call is taken to cost a full default budget; fewer calls win.
ACCELERATOR_PREFILL_COSTS = PrefillCosts(call=512, row=0)
# Another cap must save this share of the whole prompt's cost to be chosen (the fit's error).
MARGIN = 0.1


def prefill_costs(platform: str) -> PrefillCosts:
    return CPU_PREFILL_COSTS if platform == "cpu" else ACCELERATOR_PREFILL_COSTS


def rows_that_fit(takes: list[int], budget: int, max_rows: int) -> int:
    """How many of the first pieces (`takes`, tokens each) one call writes: in order, while
    its row bucket x token bucket stays within `budget` (always at least one)."""
    longest = 0
    for n, take in enumerate(takes):
        longest = max(longest, take)
        if n and bucket(n + 1, 1, max_rows) * chunk_tokens(longest, budget) > budget:
            return n
    return len(takes)


def planned_cost(remaining: list[int], cap: int, budget: int, max_rows: int,
                 costs: PrefillCosts, limit: float = float("inf")) -> float:  # fmt: skip
    """What prefilling every waiting prompt (`remaining` tokens each, in the engine's order)
    costs in calls that take at most `cap` tokens of each: the engine's calls, replayed (until
    the cost reaches `limit`)."""
    left, cost = list(remaining), 0.0
    while left and cost < limit:
        takes = [min(r, cap) for r in left]
        n = rows_that_fit(takes, budget, max_rows)
        width = chunk_tokens(max(takes[:n]), budget)
        cost += costs.call + bucket(n, 1, max_rows) * (width + costs.row)
        # A prompt not finished stays where it was, ahead of the ones not begun.
        left = [r - t for r, t in zip(left[:n], takes[:n]) if r > t] + left[n:]
    return cost


def prefill_cap(remaining: list[int], budget: int, max_rows: int, costs: PrefillCosts) -> int:
    """The most tokens of each prompt the next call takes (`budget`: whole prompts, up to the
    call's budget; or a smaller token bucket whose plan costs at least MARGIN less)."""
    *smaller, _ = buckets(SMALLEST_PREFILL, max(SMALLEST_PREFILL, budget), PREFILL_GROWTH)
    best, to_beat = budget, (1 - MARGIN) * planned_cost(remaining, budget, budget, max_rows, costs)
    for cap in reversed(smaller):  # on a tie the larger cap: fewer calls
        cost = planned_cost(remaining, cap, budget, max_rows, costs, limit=to_beat)
        if cost < to_beat:
            best, to_beat = cap, cost
    return best


class PrefillPlan:
    """An engine's caps: planned again only when the prompts being prefilled change (the plan
    holds for the same ones as they progress)."""

    def __init__(self, budget: int, max_rows: int, costs: PrefillCosts):
        self.budget, self.max_rows, self.costs = budget, max_rows, costs
        self._planned: tuple[tuple, int] = ((), budget)  # (the prompts' request ids, the cap)

    def cap(self, prefilling: list) -> int:
        """The cap for the engine's `prefilling` items (requests.Prefill, in order)."""
        key = tuple(item.request.request_id for item in prefilling)
        if self._planned[0] != key:
            remaining = [item.remaining for item in prefilling]
            self._planned = key, prefill_cap(remaining, self.budget, self.max_rows, self.costs)
        return self._planned[1]
