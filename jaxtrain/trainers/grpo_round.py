"""One GRPO round: a generated batch and what the num_iterations updates that reuse it consume
and log. A checkpoint written inside a round keeps it (the Trainer's `checkpoint_extra`), so
a resumed run finishes the round on the very batch the uninterrupted run used: sampling it
again from the resumed parameters would give other completions and other old log-probs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxtrain.parallel.process_local import process_block

__all__ = ["GeneratedRound"]

# The `kind` of a round's details in a checkpoint's metadata (what wrote its extra arrays).
ROUND_KIND = "grpo_round"


@dataclasses.dataclass
class GeneratedRound:
    """The batch of the steps `generation * n` to `generation * n + n - 1` (n: num_iterations)."""

    generation: int
    # The global train batch on the mesh: input_ids, labels, advantages (and old_logps).
    batch: dict[str, jax.Array]
    # Reward and completion statistics, logged with every update of the round.
    logs: dict[str, float]
    # The decoded completions (`trainer.last_completions`).
    completions: list[str]
    # input_ids and labels on the host: the loop counts each step's tokens from them.
    host: dict[str, np.ndarray]

    def checkpoint(self, num_iterations: int) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        """(JSON details, arrays) for `checkpoint_extra`."""
        details = {
            "kind": ROUND_KIND,
            "generation": self.generation,
            "num_iterations": num_iterations,
            "logs": self.logs,
            "completions": self.completions,
        }
        return details, self.batch

    @classmethod
    def restored(
        cls,
        details: dict[str, Any],
        restore: Callable[[Any], Any],
        abstract_batch: dict[str, jax.ShapeDtypeStruct],
    ) -> GeneratedRound:
        """The round a checkpoint kept, its arrays read onto `abstract_batch`'s layout."""
        batch = restore(abstract_batch)
        # This process's rows, as the round's source handed them to the loop.
        host = {k: process_block(batch[k]) for k in ("input_ids", "labels")}
        return cls(
            generation=int(details["generation"]),
            batch=batch,
            logs={k: float(v) for k, v in details["logs"].items()},
            completions=list(details["completions"]),
            host=host,
        )

    @staticmethod
    def fits(details: dict[str, Any], step: int, num_iterations: int) -> bool:
        """Whether a checkpoint's round is the one the resumed `step` continues (the same
        round, with the same num_iterations, and not at its boundary)."""
        return (
            details.get("kind") == ROUND_KIND
            and details.get("num_iterations") == num_iterations
            and details.get("generation") == step // num_iterations
            and step % num_iterations != 0
        )
