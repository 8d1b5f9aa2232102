"""--task grpo: group relative policy optimization on completions the policy samples (on the
serving engine) and reward functions score, beside a frozen reference when beta > 0 (with
LoRA the reference is the base without adapters)."""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtrain.config.sections import RunSettings
from jaxtrain.errors import ArgumentError
from jaxtrain.rollout_arguments import (
    GRPO_IMPORTANCE_SAMPLING_LEVELS,
    GRPO_LOSS_TYPES,
    GRPO_SAMPLER_CORRECTIONS,
    GRPO_SCALE_REWARDS,
    GRPOArguments,
)
from jaxtrain.tasks.batches import check_tokenizer
from jaxtrain.tasks.task import Task, imported


def check_prompt_files(task: str, config: dict[str, Any]) -> None:
    """What an online RL task needs of the config: prompt files and rewards (eval files are
    prompts too, scored every eval_steps)."""
    data = config.get("data") or {}
    if data.get("source", "default") != "files":
        raise ArgumentError(
            f"--task {task} samples completions of prompts and scores them with reward functions: "
            "set --data.source files --data.train_files PROMPTS.jsonl (rows with a `prompt`, "
            "plus the columns your rewards read, e.g. `answer`) and --reward "
            "last_number_matches (or module:function)."
        )
    if not config.get("reward"):
        raise ArgumentError(
            f"--task {task} needs reward functions: --reward last_number_matches, format_regex "
            "(with --format_pattern REGEX) or module:function, comma-separated."
        )
    check_tokenizer(task, "its prompts and decodes the completions for the rewards", config)


def reference_when_beta(settings: RunSettings) -> dict[str, bool]:
    """A reference when beta > 0 (with LoRA none: the base without adapters is one)."""
    return {"reference": settings.task.beta > 0 and not settings.model.lora_rank}


def no_eval_set(name: str, title: str) -> str:
    """What `jaxtrain eval` says of an online RL run (`title` the task, as a sentence begins)."""
    return (
        f"{title} run has no eval set to evaluate afterwards: --task {name}'s eval prompts "
        "(data.eval_files) are scored during training, every eval_steps (eval/reward in "
        "metrics.jsonl). Score it with `jaxtrain evaluate RUN_DIR --tasks ...`, or read "
        "`jaxtrain sample RUN_DIR`."
    )


TASK = Task(
    name="grpo",
    arguments=GRPOArguments,
    trainer="jaxtrain.trainers.grpo:GRPOTrainer",
    rows="prompt, messages or prompt_ids (+ columns for the rewards)",
    # The rollout source's own batch: the sampler correction's arrays too.
    batch=imported("jaxtrain.trainers.grpo_round:rollout_batch"),
    objective=imported("jaxtrain.trainers.grpo:grpo_objective"),
    frozen=reference_when_beta,
    check_data=partial(check_prompt_files, "grpo"),
    no_eval_set=no_eval_set("grpo", "a GRPO"),
    samples_on_engine=True,
    choices={
        "loss_type": GRPO_LOSS_TYPES,
        "scale_rewards": GRPO_SCALE_REWARDS,
        "importance_sampling_level": GRPO_IMPORTANCE_SAMPLING_LEVELS,
        "sampler_correction": GRPO_SAMPLER_CORRECTIONS,
    },
)
