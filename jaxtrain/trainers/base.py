"""What the task trainers share: concrete models, the task model's export, pair data."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.config.sections import DataSettings, ModelSettings, RunSettings
from jaxtrain.data.padding import resolve_pad_token_id
from jaxtrain.data.vision import is_processor
from jaxtrain.parallel import ModelFactory
from jaxtrain.runtime import Runtime, runtime_for
from jaxtrain.trainers.data import PairCollator, PairFeaturizer
from jaxtrain.trainers.packed import PairLayout, packed_source
from jaxtrain.trainers.sequences import real_units
from jaxtrain.trainers.vision_pairs import VisionPairFeaturizer, vision_pair_featurizer
from jaxtrain.training.trainer import Trainer

__all__ = [
    "PairTrainer",
    "TaskTrainer",
    "concrete_model",
    "pair_normalizer",
    "task_pad_token_id",
    "task_runtime",
    "task_settings",
]


def task_runtime(args: TrainingArguments, kwargs: dict[str, Any]) -> Runtime:
    """The runtime of a task trainer, resolved before its frozen models are made: the one in
    `kwargs` (checked against `args`) or one built over `kwargs`' devices. `kwargs` (the
    Trainer's keyword arguments) then carry it, and no `devices`, to the base Trainer."""
    runtime = runtime_for(args, kwargs.get("runtime"), kwargs.pop("devices", None))
    kwargs["runtime"] = runtime
    return runtime


def task_settings(args: TrainingArguments, kwargs: dict[str, Any]) -> RunSettings:
    """The sections of a task trainer's run, built once: the task trainer reads them before
    its base Trainer exists, and `kwargs` (the Trainer's keyword arguments) hand them on."""
    settings = kwargs.get("settings") or RunSettings.from_arguments(args)
    kwargs["settings"] = settings
    return settings


def concrete_model(model: Any, settings: ModelSettings, runtime: Runtime) -> nnx.Module:
    """A ModelFactory is created sharded on the run's mesh (a frozen copy needs arrays)."""
    if isinstance(model, ModelFactory):
        return model.create(
            runtime.plan,
            param_dtype=settings.param_dtype,
            compiler_options=runtime.compiler_options,
        )
    if model is None:
        raise ArgumentError("the task trainer needs a model: Trainer(arguments=..., model=...).")
    return model


def task_pad_token_id(tokenizer: Any, model: Any) -> int:
    """The pad id the Trainer will pad with (the tokenizer's, else the model config's, else
    their eos), known before it is built: a task's collator and sources take it as a number.
    `model`: a model, a TaskModel around one, or a ModelFactory."""
    return resolve_pad_token_id(tokenizer, getattr(trained_model(model), "config", None))


def trained_model(model: Any) -> Any:
    """The model a task trains: `model`, the trained part of a TaskModel, or a ModelFactory's
    abstract model."""
    trained = getattr(model, "model", model) if hasattr(model, "frozen_names") else model
    return trained.abstract() if isinstance(trained, ModelFactory) else trained


class TaskTrainer(Trainer):
    """A Trainer whose `self.model` is a TaskModel (the trained model beside frozen ones):
    the Program's exports and samples use the trained part."""


class PairTrainer(TaskTrainer):
    """Preference pairs (prompt, chosen, rejected): featurizer, collator, pair-count loss.

    The loss of an update is the sum of per-pair losses over every micro-batch divided by the
    number of real pairs of the whole global batch (filler rows count as no pair). "tokens"
    of the step's sums therefore counts pairs, so the logged loss is the mean per pair.
    `packing=True` packs the pairs' sequences into rows (trainers/packed.py).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        data = task_settings(kwargs["arguments"], kwargs).data
        user_collator = kwargs.get("data_collator") is not None
        pad = task_pad_token_id(kwargs.get("processing_class"), kwargs.get("model"))
        if is_processor(kwargs.get("processing_class")) and not user_collator:
            # Pairs whose prompts hold images: their collator knows the model's image slots.
            featurizer = self._image_pairs("dataset_train", kwargs)
            kwargs["data_collator"] = featurizer.collator
        elif not user_collator:
            kwargs["data_collator"] = PairCollator(data.seq_len, pad)
        if data.packing:
            featurizer = PairFeaturizer(
                name="dataset_train",
                tokenizer=kwargs.get("processing_class"),
                max_length=data.seq_len,
                chat_template=data.chat_template,
            )
            layout_of = lambda f: PairLayout(f.float_columns)  # noqa: E731
            dataset = kwargs.get("dataset_train")
            add_packed_source(
                kwargs,
                data,
                task_runtime(kwargs["arguments"], kwargs),
                dataset,
                featurizer,
                layout_of,
                "pairs",
                user_collator=user_collator,
                pad_token_id=pad,
            )
        super().__init__(*args, **kwargs)

    def _image_pairs(self, name: str, kwargs: dict[str, Any]) -> VisionPairFeaturizer:
        config = getattr(trained_model(kwargs.get("model")), "config", None)
        return vision_pair_featurizer(
            name, kwargs.get("processing_class"), config, kwargs["settings"].data
        )

    def create_featurizer(self, name: str) -> PairFeaturizer | VisionPairFeaturizer:
        if is_processor(self.processing_class):
            kwargs = dict(model=self.model, processing_class=self.processing_class,
                          settings=self.settings)  # fmt: skip
            return self._image_pairs(name, kwargs)
        return PairFeaturizer(
            name=name,
            tokenizer=self.processing_class,
            max_length=self.settings.data.seq_len,
            chat_template=self.settings.data.chat_template,
        )


def add_packed_source(
    kwargs: dict[str, Any],
    data: DataSettings,
    runtime: Runtime,
    dataset: Any,
    featurizer: Any,
    layout_of: Any,
    what: str,
    *,
    user_collator: bool,
    pad_token_id: int,
) -> None:
    """`kwargs` (a task trainer's, for the base Trainer) get the packed train source of
    `dataset` (trainers/packed.py); a data_collator of the user's is an error: packing
    builds its own rows."""
    if kwargs.get("train_source") is not None or dataset is None:
        return
    if user_collator:
        raise ArgumentError(
            f"packing=True packs the {what} itself; it cannot be combined with a "
            "data_collator. Drop one of them."
        )
    kwargs["train_source"] = packed_source(
        data,
        runtime,
        dataset,
        featurizer,
        layout_of,
        pad_token_id=pad_token_id,
    )


def pair_normalizer(batch: dict[str, jax.Array]) -> jax.Array:
    """The real pairs (KTO: examples) of a global batch, padded or packed (filler rows and
    empty pair slots count as none)."""
    return real_units(batch).sum()


def dataset_columns(dataset: Any) -> list[str]:
    """Column names of a datasets.Dataset, a dict of columns or a list of row dicts."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, dict):  # DatasetDict
        raise ArgumentError("pass one split (dataset['train']), not a DatasetDict")
    if names is not None:
        return list(names)
    if isinstance(dataset, dict):
        return list(dataset)
    if isinstance(dataset, (list, tuple)) and dataset and isinstance(dataset[0], dict):
        return list(dataset[0])
    return []


def add_columns(dataset: Any, columns: dict[str, np.ndarray]) -> Any:
    """`dataset` with extra columns (datasets.Dataset, dict of columns or list of rows)."""
    if hasattr(dataset, "add_column"):
        for name, values in columns.items():
            if name in dataset.column_names:
                dataset = dataset.remove_columns(name)
            dataset = dataset.add_column(name, [float(v) for v in values])
        return dataset
    if isinstance(dataset, dict):
        return {**dataset, **{k: [float(x) for x in v] for k, v in columns.items()}}
    return [
        {**row, **{k: float(v[i]) for k, v in columns.items()}} for i, row in enumerate(dataset)
    ]
