"""--task orpo: odds-ratio preference optimization (the policy alone, no reference)."""

from functools import partial

from jaxtrain.task_arguments import ORPOArguments
from jaxtrain.tasks.batches import check_files_source, pair_batch
from jaxtrain.tasks.dpo import PAIRS
from jaxtrain.tasks.task import Task, imported

TASK = Task(
    name="orpo",
    arguments=ORPOArguments,
    trainer="jaxtrain.trainers.orpo:ORPOTrainer",
    rows=PAIRS,
    batch=pair_batch,
    objective=imported("jaxtrain.trainers.orpo:orpo_objective"),
    check_data=partial(check_files_source, "orpo", PAIRS),
)
