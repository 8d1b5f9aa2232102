"""Image classification through the same Trainer: a featurizer, a collator and an objective.

The Trainer and its data pipeline were written for token batches. What an image classifier
changes is exactly three seams, nothing in the loop:
- ``ImageFeaturizer``: rows are ``{"pixel_values": [C, H, W] floats, "labels": int}``
  (column names settable); they are checked and passed through, not tokenized.
- ``ImageCollator``: a batch is ``pixel_values`` [N, C, H, W] float32 + ``labels`` [N] int32.
  Filler rows (a short last batch) get label -100 from the pipeline and count for nothing.
- the objective (``classification_sums``): cross-entropy summed over examples, ``correct``
  (logged as accuracy) and ``tokens`` = labelled examples; the loss normalizer counts them too.
Throughput then counts examples as "tokens"; model FLOPs/MFU are not counted for such batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.data.errors import DatasetError
from jaxtrain.data.featurize import Featurizer
from jaxtrain.models.vit import classification_sums
from jaxtrain.trainers.base import task_settings
from jaxtrain.training.trainer import Trainer

__all__ = ["ImageClassificationTrainer", "ImageCollator", "ImageFeaturizer"]


class ImageFeaturizer(Featurizer):
    """Rows with an image array and an integer class label, checked and passed through."""

    takes_images = True

    def __init__(
        self, *, name: str, image_column: str = "pixel_values", label_column: str = "labels"
    ):
        super().__init__(name=name)
        self.image_column, self.label_column = image_column, label_column

    def detect(self, first: Any, columns: list[str] | None = None) -> str:
        if not isinstance(first, Mapping):
            raise DatasetError(f"{self.name} row 0 is a {type(first).__name__}, expected a dict")
        missing = [c for c in (self.image_column, self.label_column) if c not in first]
        if missing:
            raise DatasetError(
                f"{self.name} has no column {missing[0]!r}; image classification needs "
                f"{self.image_column!r} ([C, H, W] numbers) and {self.label_column!r} (an int "
                f"class). Available columns: {sorted(first)}"
            )
        self.mode = "image"
        return self.mode

    def __call__(self, rows: list[dict], where: Sequence[Any]) -> list[dict]:
        if self.mode is None and rows:
            self.detect(rows[0])
        out = []
        for row, w in zip(rows, where):
            image = np.asarray(row.get(self.image_column), dtype=np.float32)
            label = row.get(self.label_column)
            if image.ndim != 3:
                raise DatasetError(
                    f"{self.name} row {w}: column {self.image_column!r} must be a [C, H, W] "
                    f"array, got shape {image.shape}"
                )
            if not isinstance(label, (int, np.integer)) or isinstance(label, bool) or label < 0:
                raise DatasetError(
                    f"{self.name} row {w}: column {self.label_column!r} must be a class index "
                    f"(int >= 0), got {label!r}"
                )
            out.append({"pixel_values": image, "labels": int(label)})
        return out


class ImageCollator:
    """Examples -> ``pixel_values`` [N, C, H, W] float32 and ``labels`` [N] int32."""

    def __call__(self, examples: list[dict]) -> dict[str, np.ndarray]:
        shapes = {np.shape(e["pixel_values"]) for e in examples}
        if len(shapes) != 1:
            raise DatasetError(f"images of one batch must share a shape, got {sorted(shapes)}")
        return {
            "pixel_values": np.stack([e["pixel_values"] for e in examples]).astype(np.float32),
            "labels": np.asarray([e["labels"] for e in examples], np.int32),
        }


class ImageClassificationTrainer(Trainer):
    """Trainer for ``model(pixel_values) -> logits [B, num_labels]`` (e.g. the ViT)."""

    loss_is_token_nll = False  # no perplexity: the loss is not a token NLL
    batch_unit = "examples"  # throughput in examples/s: an image has no tokens

    def __init__(self, arguments: TrainingArguments | None = None, *args: Any, **kwargs: Any):
        arguments = arguments if arguments is not None else TrainingArguments()
        settings = task_settings(arguments, kwargs)
        if settings.data.packing:
            raise ArgumentError("images cannot be packed; set packing=False.")
        collator = kwargs.get("data_collator") or ImageCollator()
        given = {**kwargs, "data_collator": collator, "settings": settings}
        super().__init__(arguments, *args, **given)

    def create_featurizer(self, name: str) -> ImageFeaturizer:
        return ImageFeaturizer(name=name)

    def compute_loss_sums(self, model: Any, batch: dict[str, jax.Array], rng: jax.Array):
        del rng  # no dropout
        return classification_sums(model(batch["pixel_values"]), batch["labels"])

    def loss_normalizer(self, batch: dict[str, jax.Array]) -> jax.Array:
        return (batch["labels"] >= 0).sum().astype(jnp.float32)
