"""Preference pairs whose prompts hold images (a vision-language model's DPO, TRL's vision
format): `images` (or `image`) beside `prompt`, `chosen`, `rejected` (strings or messages; without
`prompt`, the messages the two conversations share).

Each side is the prompt with its images and the side's response, made as data/vision.py makes
prompt + completion rows (the response learned, an image's tokens never; truncation keeps the
start and never cuts an image: `image_truncation` says whether such a pair is an error or is
dropped). A pair's batch row holds its chosen and rejected sequences as text pairs do
(trainers/data.py) and the prompt's images once, [N, images_per_row, C, H, W]; the objective
shows them to both sides (trainers/sequences.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxtrain.config.sections import DataSettings
from jaxtrain.data.collate import TRUNCATED_TOKENS
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.featurize import Featurizer
from jaxtrain.data.images import images_of
from jaxtrain.data.packing import ImageSlots
from jaxtrain.data.row_checks import is_finite_number
from jaxtrain.data.vision import VisionFeaturizer, check_image_model
from jaxtrain.errors import ArgumentError
from jaxtrain.trainers.data import (
    PAIR_FLOAT_COLUMNS,
    PairCollator,
    check_value,
    is_messages,
    shared_prefix,
)

__all__ = ["VisionPairCollator", "VisionPairFeaturizer", "vision_pair_featurizer"]


class VisionPairFeaturizer(Featurizer):
    """Image preference rows -> ``chosen_*``/``rejected_*`` token examples and the prompt's
    ``pixel_values`` [n, C, H, W]."""

    takes_images = True

    def __init__(self, *, name: str, **vision: Any):
        super().__init__(name=name, tokenizer=vision["processor"])
        # Each side is a prompt + completion row of this featurizer (its response learned).
        self.sides = VisionFeaturizer(name=name, completion_only_loss=True, **vision)
        self.sides.mode = "prompt_completion"
        self.float_columns: tuple[str, ...] = ()

    @property
    def collator(self) -> VisionPairCollator:
        s = self.sides
        return VisionPairCollator(
            s.max_length, s.pad_token_id, ImageSlots(s.images_per_row, s.image_shape)
        )

    def detect(self, first: Any, columns: list[str] | None = None) -> str:
        if not isinstance(first, Mapping) or not {"chosen", "rejected"} <= set(first):
            found = sorted(first) if isinstance(first, Mapping) else type(first).__name__
            raise DatasetError(
                f"{self.name}: preference rows need 'chosen' and 'rejected' (and 'prompt' or "
                f"message lists) beside their images; found {found}"
            )
        if "prompt" not in first and not is_messages(first["chosen"]):
            raise DatasetError(f"{self.name} has string 'chosen'/'rejected' but no 'prompt' column")
        self.float_columns = tuple(c for c in PAIR_FLOAT_COLUMNS if c in first)
        self.mode = "pairs"
        return self.mode

    def __call__(self, rows: list[dict[str, Any]], where: Sequence[Any]) -> list[dict[str, Any]]:
        if self.mode is None and rows:
            self.detect(rows[0])
        return [self._pair(dict(row), w) for row, w in zip(rows, where)]

    def _pair(self, row: dict[str, Any], where: Any) -> dict[str, Any]:
        label = f"{self.name} row {where}"
        chosen, rejected = row.get("chosen"), row.get("rejected")
        conversational = is_messages(chosen)
        for column, value in (("chosen", chosen), ("rejected", rejected)):
            check_value(self.name, where, column, value, conversational)
        if "prompt" in row:
            prompt = row["prompt"]
            if conversational and isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
        else:  # the messages both conversations start with
            n = shared_prefix(list(chosen), list(rejected))
            prompt, chosen, rejected = list(chosen[:n]), list(chosen[n:]), list(rejected[n:])
        images = images_of(row, label)
        out: dict[str, Any] = {TRUNCATED_TOKENS: 0}
        for side, completion in (("chosen", chosen), ("rejected", rejected)):
            unit = {"images": images, "prompt": prompt, "completion": completion}
            example = self.sides.example(unit, label)
            out[f"{side}_input_ids"], out[f"{side}_labels"] = (
                example["input_ids"],
                example["labels"],
            )
            out[TRUNCATED_TOKENS] += example.get(TRUNCATED_TOKENS, 0)
            out["pixel_values"] = example["pixel_values"]  # the prompt's: the same both sides
        if not (len(out["chosen_input_ids"]) and len(out["rejected_input_ids"])):
            empty = np.zeros(0, np.int64)  # a side was dropped (image_truncation="drop"): both
            out.update(chosen_input_ids=empty, chosen_labels=empty, rejected_input_ids=empty,
                       rejected_labels=empty, **{TRUNCATED_TOKENS: 0})  # fmt: skip
        for column in self.float_columns:
            value = row.get(column)
            if not is_finite_number(value):
                raise DatasetError(
                    f"{label}: column {column!r} must be a finite number, got {value!r}"
                )
            out[column] = float(value)
        return out


class VisionPairCollator(PairCollator):
    """PairCollator's batch and the prompts' images, ``pixel_values`` [N, slots, C, H, W]."""

    def __init__(self, seq_len: int, pad_token_id: int, image_slots: ImageSlots):
        super().__init__(seq_len, pad_token_id)
        self.image_slots = image_slots

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, np.ndarray]:
        batch = super().__call__(examples)
        rows = [self.image_slots.row([e.get("pixel_values", [])]) for e in examples]
        batch["pixel_values"] = np.stack(rows)
        return batch


def vision_pair_featurizer(
    name: str, processor: Any, model_config: Any, data: DataSettings
) -> VisionPairFeaturizer:
    """The featurizer of image pairs for a vision-language model of `model_config`."""
    check_image_model(processor, model_config)
    if data.packing:
        raise ArgumentError(
            "packing=True: preference pairs with images are not packed yet (each pair's "
            "images would need their own slots in the packed rows); set packing=False."
        )
    return VisionPairFeaturizer(
        name=name, processor=processor, image_token_id=model_config.image_token_id,
        image_shape=model_config.image_shape, max_length=data.seq_len,
        images_per_row=data.images_per_row, image_truncation=data.image_truncation,
        truncation_mode="keep_start", chat_template=data.chat_template,
    )  # fmt: skip
