"""--task rloo: REINFORCE leave-one-out (TRL's RLOOTrainer) on GRPO's rollouts: the KL to the
reference a penalty on the reward, taken at sampling time (a reference when beta > 0; with
LoRA the base without adapters)."""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtrain.task_arguments import RLOOArguments
from jaxtrain.tasks.grpo import check_prompt_files
from jaxtrain.tasks.task import Task, imported


def _frozen(args: Any) -> dict[str, bool]:
    return {"reference": args.beta > 0 and not args.lora_rank}


TASK = Task(
    name="rloo",
    arguments=RLOOArguments,
    trainer="jaxtrain.trainers.rloo:RLOOTrainer",
    rows="prompt, messages or prompt_ids (+ columns for the rewards)",
    batch=imported("jaxtrain.trainers.grpo_source:rollout_batch"),
    objective=imported("jaxtrain.trainers.rloo:rloo_objective"),
    frozen=_frozen,
    check_data=partial(check_prompt_files, "rloo"),
    no_eval_set=(
        "an RLOO run has no eval set to evaluate: --task rloo trains without data.eval_files "
        "(its reward functions score sampled completions). Score it with `jaxtrain evaluate "
        "RUN_DIR --tasks ...`, or read `jaxtrain sample RUN_DIR`."
    ),
    samples_on_engine=True,
)
