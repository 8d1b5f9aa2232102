"""--task rloo: REINFORCE leave-one-out (TRL's RLOOTrainer) on GRPO's rollouts: the KL to the
reference a penalty on the reward, taken at sampling time (a reference when beta > 0; with
LoRA the base without adapters)."""

from __future__ import annotations

from functools import partial

from jaxtrain.rollout_arguments import RLOOArguments
from jaxtrain.tasks.grpo import check_prompt_files, no_eval_set, reference_when_beta
from jaxtrain.tasks.task import Task, imported

TASK = Task(
    name="rloo",
    arguments=RLOOArguments,
    trainer="jaxtrain.trainers.rloo:RLOOTrainer",
    rows="prompt, messages or prompt_ids (+ columns for the rewards)",
    batch=imported("jaxtrain.trainers.grpo_round:rollout_batch"),
    objective=imported("jaxtrain.trainers.rloo:rloo_objective"),
    frozen=reference_when_beta,
    check_data=partial(check_prompt_files, "rloo"),
    no_eval_set=no_eval_set("rloo", "an RLOO"),
    samples_on_engine=True,
)
