"""Asynchronous rollouts (`max_staleness` k > 0): the rounds after the current one are sampled
in a background thread while the current one trains, each from a copy of the parameters of
the round that launched it, so a round trains on completions at most k rounds older than the
policy (verl's, slime's and OpenRLHF's asynchronous mode; the engine on the training devices,
or on devices of its own with `rollout_devices`).

A round's batch carries the trainer's log-probs of its tokens under the parameters that sampled
it (`old_logps`): the loss's ratio pi / pi_old and its clip correct for the lag, as for the
later updates of a round; a `sampler_correction` applies on top. The copy of the parameters is
the weight handoff: the train step donates (overwrites) the state it is given, so the sampler
cannot read it in place.

Exact resume: a checkpoint waits for the rounds in flight and keeps their batches, so the
resumed run trains on the very completions the uninterrupted one did (regenerating them would
need the older parameters, which no checkpoint holds).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.trainers.grpo_round import GeneratedRound

__all__ = ["ParameterCopy", "RoundsAhead"]

logger = logging.getLogger("jaxtrain.trainers.grpo")


@dataclasses.dataclass(frozen=True)
class ParameterCopy:
    """What sampling reads of a train state: its parameters (here a copy of them)."""

    params: Any


class RoundsAhead:
    """Rounds sampled ahead, by generation. `generate(state, generation)` samples and scores
    one round; `last_generation`: the run's last round (None: no bound known)."""

    def __init__(
        self,
        generate: Callable[[Any, int, int], GeneratedRound],
        max_staleness: int,
        last_generation: int | None,
    ):
        self.generate, self.max_staleness, self.last = generate, max_staleness, last_generation
        self._executor: ThreadPoolExecutor | None = None
        self._rounds: dict[int, Future | GeneratedRound] = {}

    def take(self, generation: int) -> tuple[GeneratedRound | None, float]:
        """(the round sampled ahead for `generation`, or None; seconds waited for it)."""
        pending = self._rounds.pop(generation, None)
        if pending is None:
            return None, 0.0
        start = time.perf_counter()
        done = pending.result() if isinstance(pending, Future) else pending
        return done, time.perf_counter() - start

    def launch(self, state: Any, generation: int) -> float:
        """Start sampling the rounds after `generation` not yet under way (up to
        max_staleness ahead) from a copy of `state`'s parameters; the copy's seconds."""
        wanted = [
            g
            for g in range(generation + 1, generation + self.max_staleness + 1)
            if g not in self._rounds and (self.last is None or g <= self.last)
        ]
        if not wanted:
            return 0.0
        start = time.perf_counter()
        copy = ParameterCopy(jax.block_until_ready(jax.tree.map(jnp.copy, state.params)))
        seconds = time.perf_counter() - start
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="jaxtrain-rollouts")
        for g in wanted:  # one worker: the rounds are sampled in order
            self._rounds[g] = self._executor.submit(self.generate, copy, g, generation)
        return seconds

    def rounds(self) -> list[GeneratedRound]:
        """Every round sampled ahead, finished (waits for those in flight), by generation."""
        for g, pending in list(self._rounds.items()):
            if isinstance(pending, Future):
                self._rounds[g] = pending.result()
        return [self._rounds[g] for g in sorted(self._rounds)]

    def restore(self, rounds: list[GeneratedRound]) -> None:
        """The rounds a checkpoint kept become the ones sampled ahead."""
        self._rounds = {r.generation: r for r in rounds}

    def close(self) -> None:
        """Wait for the rounds in flight (their sampling may not be cut off mid-step) and stop
        the worker; rounds not taken are dropped. A dropped round that failed (a reward
        function raised) is logged: the run is ending for another reason, which stays the
        one raised."""
        for generation, pending in self._rounds.items():
            error = pending.exception() if isinstance(pending, Future) else None  # waits
            if error is not None:
                logger.warning(
                    "round %d, sampled ahead and never trained (the run stopped first), "
                    "failed: %s: %s", generation, type(error).__name__, error,
                )  # fmt: skip
        self._rounds = {}
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
