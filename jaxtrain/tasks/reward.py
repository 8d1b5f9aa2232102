"""--task reward: a reward model (a score head on the backbone) trained on preference pairs
with the Bradley-Terry loss; it scores text and exports *ForSequenceClassification."""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtrain.arguments import TrainingArguments
from jaxtrain.tasks.batches import check_files_source, pair_batch
from jaxtrain.tasks.dpo import PAIRS
from jaxtrain.tasks.task import Task


def _objective(settings: Any) -> Any:
    from jaxtrain.trainers.reward import REWARD_OBJECTIVE

    return REWARD_OBJECTIVE


TASK = Task(
    name="reward",
    arguments=TrainingArguments,
    trainer="jaxtrain.trainers.reward:RewardTrainer",
    rows=PAIRS,
    batch=pair_batch,
    objective=_objective,
    reward_head=True,
    check_data=partial(check_files_source, "reward", PAIRS),
)
