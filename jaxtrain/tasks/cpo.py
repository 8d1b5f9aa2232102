"""--task cpo: contrastive preference optimization, and SimPO (loss_type simpo): the policy
alone, no reference."""

from functools import partial

from jaxtrain.task_arguments import CPO_LOSS_TYPES, CPOArguments
from jaxtrain.tasks.batches import check_files_source, pair_batch
from jaxtrain.tasks.dpo import PAIRS
from jaxtrain.tasks.task import Task, imported

TASK = Task(
    name="cpo",
    arguments=CPOArguments,
    trainer="jaxtrain.trainers.cpo:CPOTrainer",
    rows=PAIRS,
    batch=pair_batch,
    objective=imported("jaxtrain.trainers.cpo:cpo_objective"),
    check_data=partial(check_files_source, "cpo", PAIRS),
    choices={"loss_type": CPO_LOSS_TYPES},
)
