"""--task kto: Kahneman-Tversky optimization on labelled completions (or pairs, split into
a desirable and an undesirable example) against a frozen reference."""

from __future__ import annotations

from functools import partial
from typing import Any

from jaxtrain.config.sections import RunSettings
from jaxtrain.task_arguments import KTO_LOSS_TYPES, KTOArguments
from jaxtrain.tasks.batches import PAIR_KEYS, check_files_source, packed_units_batch, shapes
from jaxtrain.tasks.task import Task, imported

ROWS = "prompt, completion, label (or prompt, chosen, rejected)"


def _batch(settings: RunSettings) -> dict[str, Any]:
    if settings.data.packing:
        return packed_units_batch(settings, labelled=True)
    ints, floats = shapes(settings)
    t = settings.data.seq_len
    # The mismatched completions of KTO's KL estimate (none for apo_zero_unpaired).
    kl = {f"KL_{k}": ints(t) for k in PAIR_KEYS} if settings.task.loss_type == "kto" else {}
    return {**{k: ints(t) for k in PAIR_KEYS}, **kl, "label": floats()}


TASK = Task(
    name="kto",
    arguments=KTOArguments,
    trainer="jaxtrain.trainers.kto:KTOTrainer",
    rows=ROWS,
    batch=_batch,
    objective=imported("jaxtrain.trainers.kto:kto_objective"),
    frozen=lambda settings: {"reference": True},
    check_data=partial(check_files_source, "kto", ROWS),
    choices={"loss_type": KTO_LOSS_TYPES},
)
