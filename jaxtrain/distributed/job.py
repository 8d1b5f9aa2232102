"""What every process of a Ray run executes: build the model from its source, train, gather.

A TrainJob is pickled on the driver and unpickled in each process after the cluster is
formed. Models and states travel as host (numpy) arrays; each process places them on the
global mesh, so no process holds device arrays before `jax.distributed.initialize`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxtrain.arguments import TrainingArguments
from jaxtrain.distributed.worker import JobContext

SOURCE_KINDS = ("state", "model", "checkpoint", "new")


@dataclasses.dataclass
class ModelSource:
    """Where a run's weights come from, in the order RayDistributedTrainer.train picks it."""

    kind: str  # one of SOURCE_KINDS
    description: str
    # The architecture of a model built here ("new", "checkpoint", "state" without a model).
    config: Any = None
    build: dict[str, Any] = dataclasses.field(default_factory=dict)  # dtype, param_dtype, seed
    # A given model as (graphdef, host state): "model", or "state" with a model.
    module: tuple[Any, Any] | None = None
    state: Any = None  # a given TrainState on the host ("state")
    checkpoint: str | None = None  # step directory ("checkpoint")
    model_class: type | None = None  # None: the family's class of `config`

    def model(self) -> Any:
        """The model to hand to the Trainer: a concrete module, or a ModelFactory."""
        from flax import nnx

        from jaxtrain.parallel import ModelFactory

        if self.module is not None:
            graphdef, state = self.module
            return nnx.merge(graphdef, state)
        from jaxtrain.distributed.models import build_model

        config, build, model_class = self.config, dict(self.build), self.model_class
        return ModelFactory(lambda: build_model(config, model_class=model_class, **build))


class _Forward:
    """Process 0's hooks, sent to the driver (RayDistributedTrainer's listeners)."""

    def __init__(self, context: JobContext) -> None:
        self.context = context

    def on_train_start(self, trainer: Any, state: Any) -> None:
        import jax

        self.context.emit("start", int(jax.device_get(state.step)), {})

    def on_log(self, trainer: Any, logs: dict[str, float], step: int) -> None:
        self.context.emit("log", step, dict(logs))

    def on_evaluate(self, trainer: Any, metrics: dict[str, float], step: int) -> None:
        self.context.emit("evaluate", step, dict(metrics))

    def on_save(self, trainer: Any, checkpoint_path: str, step: int) -> None:
        self.context.emit("save", step, str(checkpoint_path))


@dataclasses.dataclass
class TrainJob:
    arguments: TrainingArguments
    source: ModelSource
    dataset_train: Any = None
    dataset_eval: Any = None
    data_collator: Any = None
    processing_class: Any = None
    callbacks: list[Any] = dataclasses.field(default_factory=list)
    trainer_class: type | None = None
    # Gather the final state onto the driver (every process joins the gather).
    return_state: bool = True

    def arguments_for(self, attempt: int) -> TrainingArguments:
        """This attempt's arguments: a restart resumes the run's newest committed checkpoint."""
        from jaxtrain.training.checkpoint import checkpoints_root, committed_steps

        changes: dict[str, Any] = {}
        if self.source.kind == "checkpoint":
            changes["resume_from"] = self.source.checkpoint
        if attempt > 0:
            changes["overwrite_output_dir"] = False  # never wipe what the first try wrote
            if committed_steps(checkpoints_root(self.arguments.output_dir)):
                changes.update(resume_from=None, resume_if_possible=True)
        return dataclasses.replace(self.arguments, **changes)

    def create_trainer(self, attempt: int = 0, callbacks: list[Any] | None = None) -> Any:
        """The Trainer this job runs in this process (attempt `attempt`), before training."""
        from jaxtrain.runtime import Runtime
        from jaxtrain.training.trainer import Trainer

        trainer_class = self.trainer_class or Trainer
        initial_state = self.source.state if self.source.kind == "state" else None
        arguments = self.arguments_for(attempt)
        runtime = Runtime.from_arguments(arguments)  # the cluster the actors formed
        return trainer_class(
            arguments=arguments,
            runtime=runtime,
            model=self.source.model(),
            dataset_train=self.dataset_train,
            dataset_eval=self.dataset_eval,
            data_collator=self.data_collator,
            processing_class=self.processing_class,
            callbacks=[*self.callbacks, *(callbacks or [])],
            initial_state=initial_state,
        )

    def run(self, context: JobContext) -> Any:
        import jax

        from jaxtrain.training.loop import TrainerOutput

        forward = [_Forward(context)] if jax.process_index() == 0 else []
        trainer = self.create_trainer(context.attempt, forward)
        output = trainer.train()
        state = gather_state(output.state) if self.return_state else None
        if jax.process_index() != 0:
            return None
        return TrainerOutput(
            state=state,
            metrics=dict(output.metrics),
            checkpoint_path=output.checkpoint_path,
            mesh=None,  # the mesh's devices belong to the cluster's processes
            stop_reason=output.stop_reason,
        )


def gather_state(state: Any) -> Any:
    """`state` as host numpy arrays, complete on every process (a collective)."""
    import jax

    if jax.process_count() == 1:
        return jax.device_get(state)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(state, tiled=True)
