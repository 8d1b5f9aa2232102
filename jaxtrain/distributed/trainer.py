"""RayDistributedTrainer: one model recipe, trained by a JAX cluster of Ray actors.

```python
rt = RayDistributedTrainer("runs/base/export", bucket_path="runs/big",
                           config_scaling_variables={"hidden_size": 256, ...},
                           config_variables={"dtype": "bfloat16"},
                           cluster=ClusterConfig(num_processes=2, devices_per_process=4))
output = rt.train(scaling_index=4, arguments=args, dataset_train=ds, dataset_eval=ds_eval)
```
`train()` starts from, in this order: a given `state`, a given `model`, the newest committed
checkpoint under `bucket_path`, a new model at `scaling_index`. Every process runs the
same `Trainer` (each reads its own share of every batch); the driver receives process 0's
logs, evaluations and saves (`listeners`) and returns its TrainerOutput with the final state
gathered onto the host.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.distributed.cluster import Attempt, ClusterConfig, run_on_cluster
from jaxtrain.distributed.config import RayDistributedConfig
from jaxtrain.distributed.job import ModelSource, TrainJob
from jaxtrain.distributed.models import (
    base_config,
    build_model,
    checkpoint_config,
    scaled_config,
)


class RayDistributedTrainer:
    """Builds models at a scaling index and trains them on a Ray-managed JAX cluster."""

    # Used when the constructor is given None (the seed document's small default recipe).
    CONFIG_SCALING_VARIABLES: ClassVar[dict[str, int]] = {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "moe_intermediate_size": 512,  # MoE families only; a dense model has no such field
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    CONFIG_VARIABLES: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        pretrained_model_name_or_path: str | dict[str, Any],
        bucket_path: str | None = None,
        *,
        processor_name_or_path: str | None = None,
        model_type: str | None = None,
        model_task: str | None = None,
        model_class: type | None = None,
        config_scaling_variables: dict[str, int] | None = None,
        config_variables: dict[str, Any] | None = None,
        cluster: ClusterConfig | None = None,
        trainer_class: type | None = None,
    ) -> None:
        """`model_type` overrides the config's family; `model_task` ("causal-lm",
        "image-classification") must be the family's; `model_class` builds new models
        (default: the family's class, jaxtrain.models.classes); `trainer_class`: the Trainer
        (sub)class every process runs (default: Trainer, ImageClassificationTrainer for
        image classification)."""
        self.config = RayDistributedConfig(
            pretrained_model_name_or_path=pretrained_model_name_or_path,
            bucket_path=bucket_path,
            processor_name_or_path=processor_name_or_path,
            model_type=model_type,
            model_task=model_task,
            config_scaling_variables=(
                self.CONFIG_SCALING_VARIABLES
                if config_scaling_variables is None
                else config_scaling_variables
            ),
            config_variables=self.CONFIG_VARIABLES
            if config_variables is None
            else config_variables,
        )
        self.cluster = cluster or ClusterConfig()
        self.trainer_class = trainer_class
        self._model_class = model_class
        # One record per attempt of the last train(): processes, and who died of what.
        self.attempts: list[Attempt] = []

    # ---------------------------------------------------------------- config
    @classmethod
    def from_config(cls, path: str | Path, **kwargs: Any) -> RayDistributedTrainer:
        """A trainer from a JSON file written by `save_config`; kwargs: cluster,
        trainer_class, model_class."""
        config = RayDistributedConfig.load(path)
        return cls(**dataclasses.asdict(config), **kwargs)

    def save_config(self, path: str | Path) -> Path:
        return self.config.save(path)

    @property
    def bucket_path(self) -> str | None:
        return self.config.bucket_path

    @property
    def model_type(self) -> str | None:
        """The family's model_type (the override, else the base config's)."""
        return self.config.model_type or getattr(self.base_config, "model_type", None)

    @property
    def model_task(self) -> str:
        """causal-lm or image-classification: the task of the family (checked against
        the model_task given)."""
        from jaxtrain.models.classes import task_of

        return task_of(self.model_type)

    @property
    def model_class(self) -> type:
        """The class new models are built with: the one given, else the family's."""
        from jaxtrain.models.classes import classes_for

        return self._model_class or classes_for(self.model_type, self.model_task)[1]

    @functools.cached_property
    def base_config(self) -> Any:
        """The unscaled config (config.json of the model directory, or the dict)."""
        return base_config(self.config)

    def create_config(self, scaling_index: int) -> Any:
        """The family's config with config_scaling_variables x scaling_index and
        config_variables."""
        return scaled_config(self.config, scaling_index)

    def create_model(
        self, config: Any, dtype: Any = None, param_dtype: Any = None, seed: int = 0
    ) -> Any:
        return build_model(
            config, model_class=self.model_class, dtype=dtype, param_dtype=param_dtype, seed=seed
        )

    def create_model_from_config(self, scaling_index: int) -> Any:
        return self.create_model(self.create_config(scaling_index), **self.config.build_options)

    # ------------------------------------------------------------- processor
    def load_processor(self) -> Any:
        """The tokenizer of processor_name_or_path (default: the model directory).

        A tokenizer without a pad token pads with its eos token (and says so in a warning).
        """
        from jaxtrain.hf.load import load_tokenizer

        source = self.config.processor_name_or_path or self.config.pretrained_model_name_or_path
        if isinstance(source, dict):
            raise ArgumentError(
                "load_processor: the model is given as a config dict, so there is no tokenizer "
                "directory; pass processor_name_or_path=<tokenizer dir>."
            )
        tokenizer = load_tokenizer(source)
        if tokenizer is None:
            raise ArgumentError(
                f"load_processor: {source} has no tokenizer files; pass "
                "processor_name_or_path=<tokenizer dir>."
            )
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ArgumentError(
                    f"the tokenizer of {source} has neither a pad nor an eos token; set "
                    "tokenizer.pad_token before training."
                )
            warnings.warn(
                f"the tokenizer of {source} has no pad token; padding with its eos token "
                f"{tokenizer.eos_token!r}.",
                UserWarning,
                stacklevel=2,
            )
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    @functools.cached_property
    def processor(self) -> Any:
        return self.load_processor()

    def process_sample_data(
        self, sample: str | list[str], max_length: int, padding_side: str = "left"
    ) -> dict[str, np.ndarray]:
        """Text -> {"input_ids", "attention_mask", "labels"} padded to max_length, through the
        data pipeline's featurizer and collator. One string gives 1-D arrays, a list of
        strings [N, max_length] ones."""
        texts = [sample] if isinstance(sample, str) else list(sample)
        rows = [{"text": t} for t in texts]
        return self._featurize(rows, max_length, padding_side, single=isinstance(sample, str))

    def process_messages_data(
        self, messages: list[Any], max_length: int, padding_side: str = "left"
    ) -> dict[str, np.ndarray]:
        """Chat messages rendered with the tokenizer's chat template -> padded ids, as
        `process_sample_data`: one conversation (a list of {"role", "content"}) gives 1-D
        arrays, a list of conversations [N, max_length] ones."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        rows = [{"messages": m} for m in conversations]
        return self._featurize(rows, max_length, padding_side, single=single)

    def _featurize(
        self, rows: list[dict[str, Any]], max_length: int, padding_side: str, *, single: bool
    ) -> dict[str, np.ndarray]:
        from jaxtrain.data import Featurizer, collate_examples

        if padding_side not in ("left", "right"):
            raise ArgumentError(f"padding_side={padding_side!r}; use 'left' or 'right'.")
        tokenizer = self.processor
        featurizer = Featurizer(name="process_data", tokenizer=tokenizer)
        examples = featurizer(rows, where=list(range(len(rows))))
        batch = collate_examples(
            examples, seq_len=max_length, pad_token_id=int(tokenizer.pad_token_id)
        )
        if padding_side == "left":
            lengths = batch["attention_mask"].sum(axis=1)
            batch = {k: _pad_left(v, lengths) for k, v in batch.items()}
        return {k: v[0] for k, v in batch.items()} if single else batch

    # ----------------------------------------------------------------- train
    def model_source(
        self, scaling_index: int, *, model: Any = None, state: Any = None
    ) -> ModelSource:
        """Where train() takes the weights from: state > model > bucket checkpoint > new."""
        import jax
        from flax import nnx

        build = self.config.build_options
        if state is not None:
            module = None
            config = getattr(model, "config", None) if model is not None else None
            if model is not None:
                graphdef, values = nnx.split(model)
                module = (graphdef, jax.device_get(values))
            else:
                config = self.create_config(scaling_index)
            step = int(jax.device_get(state.step))
            return ModelSource(
                "state",
                f"the given state (step {step})",
                config=config,
                build=build,
                model_class=self._model_class,
                module=module,
                state=jax.device_get(state),
            )
        if model is not None:
            graphdef, values = nnx.split(model)
            return ModelSource(
                "model",
                f"the given model ({type(model).__name__})",
                config=getattr(model, "config", None),
                module=(graphdef, jax.device_get(values)),
            )
        checkpoint = self.newest_bucket_checkpoint()
        if checkpoint is not None:
            config = checkpoint_config(checkpoint) or self.create_config(scaling_index)
            return ModelSource(
                "checkpoint",
                f"checkpoint {checkpoint}",
                config=config,
                build=build,
                model_class=self._model_class,
                checkpoint=str(checkpoint),
            )
        return ModelSource(
            "new",
            f"a new model at scaling_index={scaling_index}",
            config=self.create_config(scaling_index),
            build=build,
            model_class=self._model_class,
        )

    def newest_bucket_checkpoint(self) -> Path | None:
        """The newest committed checkpoint under bucket_path, or None."""
        from jaxtrain.checkpointing import checkpoints_root, committed_steps

        if self.bucket_path is None:
            return None
        # The bucket is a run's output_dir (or its checkpoints/ directory); none committed
        # yet means a new start, decided here without catching any error.
        bucket = Path(self.bucket_path).absolute()
        for root in (bucket, checkpoints_root(bucket)):
            steps = committed_steps(root)
            if steps:
                return root / str(steps[-1])
        return None

    def arguments_for(self, arguments: TrainingArguments) -> TrainingArguments:
        """The run's arguments with the mesh settings fixed by config_variables."""
        return dataclasses.replace(arguments, **self.config.argument_overrides)

    def build_job(
        self,
        scaling_index: int,
        arguments: TrainingArguments,
        dataset_train: Any,
        dataset_eval: Any = None,
        data_collator: Any = None,
        model: Any = None,
        state: Any = None,
        callbacks: list[Any] | None = None,
        return_state: bool = True,
    ) -> TrainJob:
        """What every process runs (train() runs it on the cluster)."""
        processor = None
        source = self.config.processor_name_or_path or self.config.pretrained_model_name_or_path
        if not isinstance(source, dict):
            processor = self.processor if _has_tokenizer(source) else None
        return TrainJob(
            arguments=self.arguments_for(arguments),
            source=self.model_source(scaling_index, model=model, state=state),
            dataset_train=dataset_train,
            dataset_eval=dataset_eval,
            data_collator=data_collator,
            processing_class=processor,
            callbacks=list(callbacks or []),
            trainer_class=self.trainer_class or self._default_trainer_class(),
            return_state=return_state,
        )

    def _default_trainer_class(self) -> type | None:
        if self.model_task == "image-classification":
            from jaxtrain.trainers.classification import ImageClassificationTrainer

            return ImageClassificationTrainer
        return None  # TrainJob's default: Trainer

    def create_trainer(
        self,
        arguments: TrainingArguments,
        dataset_train: Any,
        dataset_eval: Any = None,
        data_collator: Any = None,
        state: Any = None,
        *,
        scaling_index: int = 1,
        model: Any = None,
    ) -> Any:
        """The Trainer that train() runs in every process, built here in this process (not
        trained): same arguments (mesh settings of config_variables applied), model source
        (state > model > bucket checkpoint > a new model at `scaling_index`), processor and
        trainer class."""
        job = self.build_job(
            scaling_index, arguments, dataset_train, dataset_eval, data_collator, model, state
        )
        return job.create_trainer()

    @staticmethod
    def extract_column_names(dataset: Any) -> list[str] | None:
        """The column names of `dataset`: a datasets.Dataset (or IterableDataset with known
        features), a DatasetDict (its first split), a dict of columns, or a list of row
        dicts (the first row's keys); None when it has none to tell."""
        names = getattr(dataset, "column_names", None)
        if isinstance(names, dict):  # DatasetDict: split -> names
            names = next(iter(names.values()), None)
        if names is not None:
            return list(names)
        features = getattr(dataset, "features", None)
        if features is not None:
            return list(features)
        if isinstance(dataset, dict):
            return [str(k) for k in dataset]
        if isinstance(dataset, (list, tuple)) and dataset and isinstance(dataset[0], dict):
            return [str(k) for k in dataset[0]]
        return None

    def train(
        self,
        scaling_index: int,
        arguments: TrainingArguments,
        dataset_train: Any,
        dataset_eval: Any = None,
        data_collator: Any = None,
        model: Any = None,
        state: Any = None,
        *,
        callbacks: list[Any] | None = None,
        listeners: list[Any] | None = None,
        cluster: ClusterConfig | None = None,
        return_state: bool = True,
    ) -> Any:
        """Train on the cluster; process 0's TrainerOutput (state on the host, mesh None).

        `callbacks` run inside every process (TrainerCallback hooks); `listeners` run here,
        on the driver, and receive process 0's `on_train_start`, `on_log`, `on_evaluate`
        and `on_save` with this RayDistributedTrainer as `trainer`. A restart after a process
        died resumes from the newest committed checkpoint in arguments.output_dir.
        """
        job = self.build_job(
            scaling_index,
            arguments,
            dataset_train,
            dataset_eval,
            data_collator,
            model,
            state,
            callbacks,
            return_state,
        )
        self.attempts = []
        return run_on_cluster(
            lambda attempt: job,
            cluster or self.cluster,
            on_event=self._dispatcher(list(listeners or [])),
            attempts=self.attempts,
        )

    def _dispatcher(self, listeners: list[Any]):
        from jaxtrain.training.hooks import call_hooks

        def dispatch(kind: str, step: int, data: Any) -> None:
            if kind == "start":
                call_hooks(listeners, "on_train_start", self, step)
            elif kind == "log":
                call_hooks(listeners, "on_log", self, data, step)
            elif kind == "evaluate":
                call_hooks(listeners, "on_evaluate", self, data, step)
            elif kind == "save":
                call_hooks(listeners, "on_save", self, data, step)
            elif kind == "restart":
                call_hooks(listeners, "on_restart", self, data)

        return dispatch


def _has_tokenizer(source: str) -> bool:
    from jaxtrain.hf.load import TOKENIZER_FILES

    path = Path(source)
    return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES)


def _pad_left(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Right-padded rows (`lengths` real tokens first) with their padding moved to the left."""
    return np.stack(
        [np.roll(row, row.shape[0] - int(n)) for row, n in zip(values, lengths)]
    ).astype(values.dtype)
