"""What the task trainers share: concrete models, the task model's export, pair data."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx

from jaxtrain.arguments import ArgumentError, TrainingArguments, task_fields
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
    "TaskStart",
    "TaskTrainer",
    "concrete_model",
    "pair_normalizer",
    "task_arguments",
    "task_pad_token_id",
    "task_settings",
]


TaskArguments = TypeVar("TaskArguments", bound=TrainingArguments)

# The keyword arguments a task trainer resolves itself before its base Trainer exists.
RESOLVED = ("devices", "runtime", "settings")


@dataclasses.dataclass(frozen=True)
class TaskStart:
    """What a task trainer resolves once, before the base Trainer exists (its frozen models
    are made on the run's mesh, its sources read the sections): the run's sections and
    runtime, and the caller's other keyword arguments. The caller's dict is left as it was."""

    settings: RunSettings
    runtime: Runtime
    rest: Mapping[str, Any]  # the caller's keyword arguments but `RESOLVED`

    @classmethod
    def resolve(
        cls,
        args: TrainingArguments,
        kwargs: Mapping[str, Any],
        *,
        settings: RunSettings | None = None,
        devices: Sequence[jax.Device] | None = None,
    ) -> TaskStart:
        """The sections (`settings`, else the caller's, else built from `args`) and the
        runtime (the caller's, checked against `args`, else built over `devices`, else over
        the caller's `devices`)."""
        settings = settings or kwargs.get("settings") or RunSettings.from_arguments(args)
        if devices is None:
            devices = kwargs.get("devices")
        runtime = runtime_for(args, kwargs.get("runtime"), devices)
        rest = {name: value for name, value in kwargs.items() if name not in RESOLVED}
        return cls(settings, runtime, rest)

    def trainer_kwargs(self, **parts: Any) -> dict[str, Any]:
        """The base Trainer's keyword arguments: the caller's, the task's `parts` over them,
        and the resolved sections and runtime."""
        return {**self.rest, **parts, "settings": self.settings, "runtime": self.runtime}


def task_arguments(
    arguments: TrainingArguments | None, wanted: type[TaskArguments], trainer: str
) -> TaskArguments:
    """A task trainer's arguments: `wanted()` when none are given; plain TrainingArguments
    (or another task's) are an ArgumentError that names the class and the fields it adds."""
    if arguments is None:
        return wanted()
    if not isinstance(arguments, wanted):
        own = task_fields(wanted)
        raise ArgumentError(
            f"{trainer} needs {wanted.__name__} (TrainingArguments plus "
            f"{', '.join(own[:3])}{', ...' if len(own) > 3 else ''}), got "
            f"{type(arguments).__name__}: build {wanted.__name__}(...) with the same fields."
        )
    return arguments


def task_settings(args: TrainingArguments, kwargs: Mapping[str, Any]) -> RunSettings:
    """The sections of a task trainer's run: the caller's (`settings=`), else built from
    `args`; a trainer that needs no runtime before its base hands them on as `settings=`."""
    return kwargs.get("settings") or RunSettings.from_arguments(args)


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
        start = TaskStart.resolve(kwargs["arguments"], kwargs)
        data = start.settings.data
        tokenizer, collator = kwargs.get("processing_class"), kwargs.get("data_collator")
        pad = task_pad_token_id(tokenizer, kwargs.get("model"))
        featurizer = pair_featurizer("dataset_train", tokenizer, kwargs.get("model"), data)
        if collator is None:  # pairs whose prompts hold images: the model's image slots too
            collator = getattr(featurizer, "collator", None) or PairCollator(data.seq_len, pad)
        source = kwargs.get("train_source")
        if data.packing:
            source = packed_train_source(
                kwargs.get("dataset_train"),
                data,
                start.runtime,
                featurizer,
                lambda f: PairLayout(f.float_columns),
                "pairs",
                pad_token_id=pad,
                given_source=source,
                given_collator=kwargs.get("data_collator"),
            )
        super().__init__(*args, **start.trainer_kwargs(data_collator=collator, train_source=source))

    def create_featurizer(self, name: str) -> PairFeaturizer | VisionPairFeaturizer:
        return pair_featurizer(name, self.processing_class, self.model, self.settings.data)


def pair_featurizer(
    name: str, tokenizer: Any, model: Any, data: DataSettings
) -> PairFeaturizer | VisionPairFeaturizer:
    """The featurizer of `name`'s pairs: text pairs, or with a processor (`tokenizer`) pairs
    whose prompts hold images, laid out for `model`'s image slots."""
    if is_processor(tokenizer):
        config = getattr(trained_model(model), "config", None)
        return vision_pair_featurizer(name, tokenizer, config, data)
    return PairFeaturizer(
        name=name, tokenizer=tokenizer, max_length=data.seq_len, chat_template=data.chat_template
    )


def packed_train_source(
    dataset: Any,
    data: DataSettings,
    runtime: Runtime,
    featurizer: Any,
    layout_of: Any,
    what: str,
    *,
    pad_token_id: int,
    given_source: Any,
    given_collator: Any,
) -> Any:
    """The packed train source of `dataset` (trainers/packed.py), or the task trainer's
    caller's own `train_source` (`given_source`); None without either. A data_collator of the
    caller's is an error: packing builds its own rows."""
    if given_source is not None or dataset is None:
        return given_source
    if given_collator is not None:
        raise ArgumentError(
            f"packing=True packs the {what} itself; it cannot be combined with a "
            "data_collator. Drop one of them."
        )
    return packed_source(data, runtime, dataset, featurizer, layout_of, pad_token_id=pad_token_id)


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
