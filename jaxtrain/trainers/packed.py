"""`packing=True` for the preference trainers: their units packed padding-free into rows.

A pair (DPO, reward model, ORPO, CPO) is two sequences, prompt + chosen and prompt +
rejected; a KTO example is its prompt + completion and, for the KL estimate, its prompt + the
previous example's completion (the first example of a micro-batch takes the last one's, as
the padded collator rotates them). `packed_source` builds the train batches from them with
data/unit_packing.py: `total_batch_size` then counts rows of `max_sequence_length` tokens (as
for SFT's packing), and each step holds as many units as fit them, at most
rows x max_sequence_length / 4. Evaluation stays padded (one sequence per row).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxtrain.arguments import ArgumentError
from jaxtrain.config.sections import DataSettings
from jaxtrain.data.assemble import Collation
from jaxtrain.data.batch_source import LoaderSource
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.loader import prepare_source
from jaxtrain.data.sources import IterableSource, as_source
from jaxtrain.data.streams import StreamUnits
from jaxtrain.data.unit_loader import UnitLoader
from jaxtrain.data.unit_packing import MIN_UNIT_TOKENS, pack_units
from jaxtrain.data.units import MapUnits
from jaxtrain.runtime import Runtime
from jaxtrain.trainers.kto_data import kto_sequence

__all__ = ["KTOLayout", "PairLayout", "packed_source", "units_per_micro_batch"]


class PairLayout:
    """A preference pair: side 0 = prompt + chosen, side 1 = prompt + rejected."""

    sides = 2

    def __init__(self, float_columns: tuple[str, ...] = ()):
        self.float_columns = tuple(float_columns)

    def sequences(self, example: dict[str, Any], previous: Any) -> list[tuple]:
        del previous
        return [
            (0, example["chosen_input_ids"], example["chosen_labels"]),
            (1, example["rejected_input_ids"], example["rejected_labels"]),
        ]

    def closing(self, first: Any, last: Any) -> list[tuple]:
        return []


class KTOLayout:
    """A KTO example: side 0 = prompt + completion, side 1 (with `kl`) = prompt + the previous
    example's completion; the micro-batch's first example takes the last one's on closing."""

    float_columns = ("label",)

    def __init__(self, seq_len: int, kl: bool):
        self.seq_len, self.kl = seq_len, kl
        self.sides = 2 if kl else 1

    def _pair(self, side: int, prompt_of: dict[str, Any], completion_of: dict[str, Any]):
        ids, labels = kto_sequence(
            prompt_of["prompt_ids"], completion_of["completion_ids"], self.seq_len
        )
        return side, ids, labels

    def sequences(self, example: dict[str, Any], previous: dict[str, Any] | None) -> list[tuple]:
        out = [self._pair(0, example, example)]
        if self.kl and previous is not None:
            out.append(self._pair(1, example, previous))
        return out

    def closing(self, first: dict[str, Any], last: dict[str, Any]) -> list[tuple]:
        return [self._pair(1, first, last)] if self.kl else []


def units_per_micro_batch(rows: int, seq_len: int) -> int:
    """The unit slots of a micro-batch of `rows` rows: never fewer than the units that fit."""
    return rows * max(seq_len // MIN_UNIT_TOKENS, 1)


def packed_source(
    settings: DataSettings,
    runtime: Runtime,
    dataset: Any,
    featurizer: Any,
    layout_of: Any,
    *,
    pad_token_id: int,
) -> LoaderSource:
    """The packed train batches of a preference trainer: `featurizer` turns rows into
    examples, `layout_of(featurizer)` (after its first row is seen) into sequences; the pad
    id is `pad_token_id`."""
    name = "dataset_train"
    if not settings.fixed_length:
        raise DatasetError(
            f"{name} with packing=True has no known number of steps per epoch (the pairs a "
            "step holds depend on their lengths); set max_steps (e.g. --max_steps 1000)"
        )
    if settings.epoch_evaluation:
        raise DatasetError(
            "evaluation_strategy='epoch' needs a known epoch length, which packing=True does "
            "not have; use evaluation_strategy='steps'"
        )
    count, index = runtime.process_count, runtime.process_index
    rows = settings.micro_batch_size // count
    if rows < 2:
        raise ArgumentError(
            f"packing=True puts each pair's two sequences in one micro-batch: give each process "
            f"at least 2 rows per micro-batch (total_batch_size / gradient_accumulation_steps / "
            f"processes = {rows})"
        )
    source = as_source(dataset, name=name, streaming=settings.streaming)
    prepare_source(source, featurizer)
    layout = layout_of(featurizer)
    common = dict(
        seed=settings.seed, shuffle=settings.shuffle, process_index=index, process_count=count
    )
    if isinstance(source, IterableSource):
        units: Any = StreamUnits(source, featurizer, window=settings.stream_window, **common)
    else:
        units = MapUnits(source, featurizer, **common)
    capacity = units_per_micro_batch(rows, settings.seq_len)

    def pack(stream: Any) -> tuple[dict[str, np.ndarray], Any]:
        return pack_units(
            stream,
            layout,
            rows=rows,
            seq_len=settings.seq_len,
            capacity=capacity,
            pad_token_id=int(pad_token_id),
            process_index=index,
            process_count=count,
        )

    collation = Collation(name=name, seq_len=settings.seq_len, pad_token_id=0)  # not used
    loader = UnitLoader(
        units,
        collation,
        global_batch_size=settings.global_batch_size,
        accumulation_steps=settings.accumulation_steps,
        packing=False,
        unit_packer=pack,
    )
    layout_check = runtime.plan.batch
    layout_check.check(settings.micro_batch_size, settings.seq_len, "micro-batch size")
    return LoaderSource(loader, layout_check, prefetch_batches=settings.prefetch_batches)
