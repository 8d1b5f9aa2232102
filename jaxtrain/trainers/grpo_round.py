"""One GRPO round: a generated batch and what the num_iterations updates that reuse it consume
and log. A checkpoint written inside a round keeps it (the Trainer's `checkpoint_extra`), so
a resumed run finishes the round on the very batch the uninterrupted run used: sampling it
again from the resumed parameters would give other completions and other old log-probs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.config.sections import RunSettings
from jaxtrain.parallel.process_local import process_block

__all__ = ["GeneratedRound", "rollout_batch"]

# The `kind` of a round's details in a checkpoint's metadata (what wrote its extra arrays).
ROUND_KIND = "grpo_round"
# ... of several rounds: the current one (if inside it) and those sampled ahead (async).
ROUNDS_KIND = "grpo_rounds"


def rollout_batch(
    settings: RunSettings,
    image_shape: tuple[int, ...] | None = None,
    routing: tuple[int, int] | None = None,
) -> dict[str, jax.ShapeDtypeStruct]:
    """The global train batch a round makes ([A, M, ...], unplaced): what the source hands the
    step and what `jaxtrain plan --task grpo` compiles it for; with a vision-language model's
    `image_shape`, each row's prompt images in `images_per_row` slots; with a MoE policy's
    `routing` shape (MoeConfig.routing_shape) and routing_replay, the sampler's experts of
    every token [A, M, S, T, k] (-1: none recorded)."""
    a = settings.data.accumulation_steps
    m, t = (
        settings.data.global_batch_size // a,
        settings.task.max_prompt_length + settings.task.max_completion_length,
    )
    shapes = {
        "input_ids": ((a, m, t), jnp.int32),
        "labels": ((a, m, t), jnp.int32),
        "advantages": ((a, m), jnp.float32),
    }
    if settings.task.num_iterations > 1 or settings.task.max_staleness > 0:  # the sampling policy's
        shapes["old_logps"] = ((a, m, t - 1), jnp.float32)
    if settings.task.sampler_correction != "none":
        shapes["sampler_logps"] = ((a, m, t - 1), jnp.float32)
        shapes["sampler_weight"] = ((a, m, t - 1), jnp.float32)
    if image_shape is not None:
        shapes["pixel_values"] = ((a, m, settings.data.images_per_row, *image_shape), jnp.float32)
    if routing is not None and settings.task.routing_replay:
        shapes["routing"] = ((a, m, routing[0], t, routing[1]), jnp.int16)
    return {k: jax.ShapeDtypeStruct(shape, dtype) for k, (shape, dtype) in shapes.items()}


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

    @staticmethod
    def checkpoint_rounds(
        rounds: list[GeneratedRound], num_iterations: int
    ) -> tuple[dict[str, Any], dict[str, dict[str, jax.Array]]]:
        """(JSON details, arrays) of several rounds, each under its generation."""
        details = [r.checkpoint(num_iterations)[0] for r in rounds]
        arrays = {str(r.generation): r.batch for r in rounds}
        return {"kind": ROUNDS_KIND, "num_iterations": num_iterations, "rounds": details}, arrays

    @classmethod
    def restored_rounds(
        cls,
        details: dict[str, Any],
        restore: Callable[[Any], Any],
        abstract_batch: dict[str, jax.ShapeDtypeStruct],
    ) -> list[GeneratedRound]:
        """The rounds `checkpoint_rounds` kept (none from a checkpoint of another kind)."""
        if details.get("kind") == ROUND_KIND:
            return [cls.restored(details, restore, abstract_batch)]
        if details.get("kind") != ROUNDS_KIND:
            return []
        keys = [str(r["generation"]) for r in details["rounds"]]
        batches = restore({k: abstract_batch for k in keys})
        return [
            cls.restored(r, lambda _, k=k: batches[k], abstract_batch)
            for r, k in zip(details["rounds"], keys)
        ]

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
