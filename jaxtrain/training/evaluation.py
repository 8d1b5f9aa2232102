"""Evaluation: token-weighted metrics over a whole eval set, read one batch late.

The Trainer owns one `Evaluator`; it compiles the eval step at the first batch and keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

from jaxtrain.objective import Difference
from jaxtrain.observability.metrics import eval_summary
from jaxtrain.training.step import make_eval_step


class Evaluator:
    """Runs a jitted eval step over batches and accumulates token-weighted sums."""

    def __init__(
        self,
        *,
        graphdef: Any,
        rest: Any,
        loss_sums_fn: Callable[..., Any],
        jit: Callable[..., Any] | None = None,
        perplexity: bool = True,
        differences: Sequence[Difference] = (),
        global_scalars_fn: Callable[..., Any] | None = None,
    ):
        # The non-Param state goes in as an argument (placed on the mesh), not as a constant.
        self._step_fn = make_eval_step(
            graphdef=graphdef, loss_sums_fn=loss_sums_fn, global_scalars_fn=global_scalars_fn
        )
        self._rest = rest
        self._compiled = None
        # jit(fn, name) -> a TrackedJit (RunMonitor.jit): its compiles are logged.
        self._jit = jit
        self._perplexity = perplexity  # the loss is a per-token NLL (objective.py)
        self._differences = tuple(differences)  # logged differences of means (objective.py)

    def compile(self, params: Any, batch: Any) -> Callable[..., Any]:
        if self._jit is not None:
            tracked = self._jit(self._step_fn, "eval_step")
            tracked.compile(params, batch, self._rest)
            return tracked
        return jax.jit(self._step_fn).lower(params, batch, self._rest).compile()

    def run(
        self, params: Any, batches: Iterable[Any], max_batches: int | None = None
    ) -> Iterator[dict[str, float]]:
        """Yields running metrics after each batch; the last covers every batch seen."""
        totals: dict[str, float] = {}
        previous = None
        count = 0
        for index, batch in enumerate(batches):
            if max_batches is not None and index >= max_batches:
                break
            if self._compiled is None:
                self._compiled = self.compile(params, batch)
            sums = self._compiled(params, batch, self._rest)
            # Read the previous batch's sums only after this one is dispatched.
            if previous is not None:
                count += 1
                yield self._summary(totals, previous, count)
            previous = sums
        if previous is not None:
            count += 1
            yield self._summary(totals, previous, count)

    def _summary(self, totals: dict[str, float], sums: Any, batches: int) -> dict[str, float]:
        return eval_summary(
            totals,
            jax.device_get(sums),
            batches,
            perplexity=self._perplexity,
            differences=self._differences,
        )
