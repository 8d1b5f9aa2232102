"""Supervised fine-tuning: the base Trainer's chat path, named so that users find it.

Rows: ``text``, ``messages`` (chat template) or ``prompt`` + ``completion`` (strings or
message lists). Differences from the base Trainer: the loss is on the responses only
(``completion_only_loss=True``) and packing is on whenever the run has a known length
(``max_steps`` set; packing cannot be used with epoch-based runs).
"""

from __future__ import annotations

from typing import Any

from jaxtrain.arguments import TrainingArguments
from jaxtrain.data.vision import VisionFeaturizer, check_image_model, is_processor
from jaxtrain.task_arguments import SFTArguments
from jaxtrain.trainers.data import SFTFeaturizer
from jaxtrain.training.trainer import Trainer

__all__ = ["SFTArguments", "SFTTrainer"]


class SFTTrainer(Trainer):
    """Trainer with SFT defaults (SFTArguments) and ``prompt``/``completion`` rows."""

    def __init__(self, arguments: TrainingArguments | None = None, model: Any = None, **kwargs):
        super().__init__(arguments if arguments is not None else SFTArguments(), model, **kwargs)

    def create_featurizer(self, name: str) -> SFTFeaturizer | VisionFeaturizer:
        data = self.settings.data
        rows = dict(
            name=name,
            text_column=data.text_column,
            messages_column=data.messages_column,
            completion_only_loss=data.completion_only_loss,
            chat_template=data.chat_template,
            drop_columns=data.drop_columns,
            max_length=data.seq_len,
        )
        if not is_processor(self.processing_class):
            return SFTFeaturizer(tokenizer=self.processing_class, **rows)
        # Rows with images, for a vision-language model and its processor.
        config = self.model_config
        check_image_model(self.processing_class, config)
        return VisionFeaturizer(
            processor=self.processing_class,
            image_token_id=config.image_token_id,
            image_shape=config.image_shape,
            images_per_row=data.images_per_row,
            image_truncation=data.image_truncation,
            truncation_mode=data.truncation_mode,
            **rows,
        )
