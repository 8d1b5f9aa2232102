"""--task dpo: direct preference optimization against a frozen reference (none when
reference_free; with LoRA the reference is the base without adapters)."""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtrain.config.sections import RunSettings
from jaxtrain.errors import ArgumentError
from jaxtrain.task_arguments import DPO_LOSS_TYPES, DPOArguments
from jaxtrain.tasks.batches import check_files_source, pair_batch
from jaxtrain.tasks.task import Task, imported

PAIRS = "prompt, chosen, rejected"


def _batch(settings: RunSettings) -> dict[str, Any]:
    if settings.task.precompute_reference_logps:
        raise ArgumentError(
            "--task dpo with precompute_reference_logps: the step then reads the reference "
            "log-probs from the batch; plan it with reference_free=true (the same program: no "
            "reference model on the devices)."
        )
    return pair_batch(settings)


def _frozen(settings: RunSettings) -> dict[str, bool]:
    return {"reference": not (settings.task.reference_free or settings.model.lora_rank)}


TASK = Task(
    name="dpo",
    arguments=DPOArguments,
    trainer="jaxtrain.trainers.dpo:DPOTrainer",
    rows=PAIRS,
    batch=_batch,
    objective=imported("jaxtrain.trainers.dpo:dpo_objective"),
    frozen=_frozen,
    check_data=partial(check_files_source, "dpo", PAIRS),
    choices={"loss_type": DPO_LOSS_TYPES},
)
