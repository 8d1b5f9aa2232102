"""What `jaxtrain plan --task TASK` compiles: each task's model (with its frozen parts), its
objective and the batch its train step takes, from shapes alone, as its trainer builds them.

- lm, sft: the causal LM loss on [A, M, T] token rows (segment ids and positions when packed);
- dpo: the policy beside a frozen reference (none when reference_free), DPO's loss on pairs;
- reward: a RewardModel around the backbone, the Bradley-Terry loss on pairs;
- kto: the policy beside a frozen reference, KTO's loss on examples with their mismatched KL
  sequences (none for apo_zero_unpaired);
- orpo, cpo: the policy alone (no reference), their losses on pairs;
- distill: the student beside a frozen teacher of the same architecture;
- with packing=True, the preference tasks' rows of packed sequences and their per-unit slots;
- grpo: the policy beside a frozen reference when beta > 0 (with LoRA the base is the policy
  without adapters), the clipped surrogate on generated rows of max_prompt_length +
  max_completion_length tokens with their advantages (and old log-probs when
  num_iterations > 1, the sampler's log-probs and weights with a sampler_correction): the
  batch is the rollout source's own `rollout_batch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.config.tables import TASKS
from jaxtrain.errors import ArgumentError

__all__ = ["task_batch", "task_model_and_objective"]

PAIR_KEYS = ("input_ids", "labels", "attention_mask")
PACKED_UNIT_TASKS = ("dpo", "reward", "kto", "orpo", "cpo")


def task_model_and_objective(
    task: str, build: Callable[[], Any], args: Any
) -> tuple[Callable[[], Any], Any]:
    """(a zero-argument builder of the task's model, its Objective or None for the LM loss).
    The model is the task's own definition (trainers/tasks.py), as its trainer trains it."""
    if task not in TASKS:
        raise ArgumentError(f"--task {task!r}: choose one of {', '.join(TASKS)}.")
    from jaxtrain.trainers.tasks import task_model

    model = lambda: task_model(task, build, args)  # noqa: E731
    if task in ("lm", "sft"):
        return model, None
    if task == "dpo":
        from jaxtrain.trainers.dpo import dpo_objective

        if args.precompute_reference_logps:
            raise ArgumentError(
                "--task dpo with precompute_reference_logps: the step then reads the "
                "reference log-probs from the batch; plan it with reference_free=true (the "
                "same program: no reference model on the devices)."
            )
        return model, dpo_objective(args)
    if task == "kto":
        from jaxtrain.trainers.kto import kto_objective

        return model, kto_objective(args)
    if task == "orpo":
        from jaxtrain.trainers.orpo import orpo_objective

        return model, orpo_objective(args)
    if task == "cpo":
        from jaxtrain.trainers.cpo import cpo_objective

        return model, cpo_objective(args)
    if task == "reward":
        from jaxtrain.trainers.reward import REWARD_OBJECTIVE

        return model, REWARD_OBJECTIVE
    if task == "distill":
        from jaxtrain.trainers.distill import distill_objective

        return model, distill_objective(args)
    from jaxtrain.trainers.grpo import grpo_objective

    return model, grpo_objective(args)


def task_batch(task: str, args: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch a task's train step takes: [A, M, ...] ShapeDtypeStructs."""
    a, m = args.gradient_accumulation_steps, args.micro_batch_size
    ints = lambda *shape: jax.ShapeDtypeStruct((a, m, *shape), jnp.int32)  # noqa: E731
    floats = lambda *shape: jax.ShapeDtypeStruct((a, m, *shape), jnp.float32)  # noqa: E731
    t = args.max_sequence_length
    if task in PACKED_UNIT_TASKS and args.packing:  # rows of packed units (trainers/packed.py)
        from jaxtrain.trainers.packed import units_per_micro_batch

        units = units_per_micro_batch(m, t)
        keys = ("input_ids", "labels", "attention_mask", "segment_ids", "positions")
        batch = {k: ints(t) for k in (*keys, "sequence_index")}
        batch["pair_mask"] = jax.ShapeDtypeStruct((a, units), jnp.float32)
        if task == "kto":
            batch["label"] = jax.ShapeDtypeStruct((a, units), jnp.float32)
        return batch
    if task in ("dpo", "reward", "orpo", "cpo"):
        return {
            **{k: ints(t) for k in PAIR_KEYS},
            **{f"rejected_{k}": ints(t) for k in PAIR_KEYS},
        }
    if task == "kto":
        kl = {f"KL_{k}": ints(t) for k in PAIR_KEYS} if args.loss_type == "kto" else {}
        return {**{k: ints(t) for k in PAIR_KEYS}, **kl, "label": floats()}
    if task == "grpo":  # the source's own definition (its sampler correction's arrays too)
        from jaxtrain.trainers.grpo_source import rollout_batch

        return rollout_batch(args)
    keys = ["input_ids", "attention_mask", "labels"]
    if args.packing:
        keys += ["segment_ids", "positions"]
    return {k: ints(t) for k in keys}
