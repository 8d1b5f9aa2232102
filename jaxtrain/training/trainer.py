"""The Trainer: a run = runtime + program + batch sources + checkpoints + monitor + hooks.

`__init__` reads top to bottom as the start of a run: the runtime (cluster, mesh, sharding
plan, XLA options: jaxtrain.runtime), the model adopted for the run (program.ModelParts), the
batch sources (checked before anything compiles), the monitor, the Program (optimizer,
shardings, the compiled steps: training/program.py) and the checkpoints. `train()` hands one
run to `loop.TrainingLoop`. The math lives in `step.py` and `logps.py` (pure, jitted), data in
`jaxtrain.data`, sharding in `jaxtrain.parallel`, checkpoint files in `jaxtrain.checkpointing`
(the run's side of them in trainer_checkpoints.py), measurements in `jaxtrain.observability`.

A task is a configuration of these parts, given in one pass: an `objective` (what the step
minimises, objective.py), a `featurizer` (rows -> examples) and a collator, or a whole
`train_source` (GRPO's rollouts). A subclass may instead override `compute_loss_sums` /
`loss_normalizer` (they then replace the objective's; `super()` gives the task's) /
`create_featurizer`, and react to the run through the TrainerCallback hooks (define any of
them on the subclass).

What the loop reads: `program`, `runtime`, `monitor`, `hooks`, `checkpoints`,
`train_source`, `evaluates`, `evaluate()`, `should_stop`, `settings`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.config.checks import check_warmup
from jaxtrain.config.sections import RunSettings
from jaxtrain.data import build_eval_loader, build_mixture_loader, build_train_loader
from jaxtrain.data.batch_source import BatchSource, LoaderSource, eval_global_batches
from jaxtrain.data.padding import resolve_pad_token_id
from jaxtrain.errors import TaskError
from jaxtrain.evaluation.harness import TaskSuite
from jaxtrain.observability.monitor import RunMonitor
from jaxtrain.parallel import ModelFactory
from jaxtrain.parallel.dry_run import dry_run_report
from jaxtrain.runtime import Runtime, runtime_for
from jaxtrain.state import TrainState
from jaxtrain.training.hooks import HookSet, ScheduledHook
from jaxtrain.training.loop import TrainerOutput, TrainingLoop
from jaxtrain.training.mixture_objective import mixture_objective
from jaxtrain.training.optim import run_optimizer
from jaxtrain.training.program import ModelParts, Objective, Program
from jaxtrain.training.state import param_logical_axes
from jaxtrain.training.step import causal_lm_loss_sums, count_target_tokens
from jaxtrain.training.trainer_checkpoints import RunCheckpointer

__all__ = ["Trainer", "TrainerOutput"]


class Trainer:
    """Train a Flax NNX causal LM (or any module returning logits) on a dataset.

    The model object you pass is changed in place, in three ways:
    - at construction, `arguments.dtype` (when set) becomes the compute `dtype` of every
      submodule that has one, and `arguments.gradient_checkpointing` becomes the model's
      `remat_policy`; build a fresh model if you need the original settings back;
    - during `train()` its parameter arrays are the training state's (no second copy of the
      parameters exists; the steps donate them, so read the model from the state that hooks
      receive, `trainer.model_from_state(state)`, not from the object itself);
    - when `train()` returns or fails, the model holds the newest parameters (in
      `param_dtype`). `create_state()` gives a state with its own copy.
    A `ModelFactory` is never built unsharded; `trainer.model` is then its abstract model.
    """

    # The loss is a mean negative log-likelihood per token, so exp(loss) is logged as
    # perplexity; a subclass whose objective is another loss sets False (objective.py).
    loss_is_token_nll: bool = True
    # What a batch's targets are, for throughput: "tokens" (tokens/s) or "examples".
    batch_unit: str = "tokens"

    def __init__(
        self,
        arguments: TrainingArguments | None = None,
        model: nnx.Module | ModelFactory | None = None,
        dataset_train: Any = None,
        dataset_eval: Any = None,
        data_collator: Callable[[list[dict]], dict[str, np.ndarray]] | None = None,
        processing_class: Any = None,
        callbacks: list[Any] | None = None,
        devices: list[jax.Device] | None = None,
        runtime: Runtime | None = None,
        *,
        objective: Objective | None = None,
        featurizer: Callable[[str], Any] | None = None,
        train_source: BatchSource | None = None,
        initial_state: TrainState | None = None,
        settings: RunSettings | None = None,
    ):
        """`runtime`: the run's environment (cluster, mesh and plan, XLA options), built from
        `arguments` over `devices` (default all) when not given. `objective`, `featurizer`
        (name -> Featurizer) and `train_source` configure a task (the module docstring);
        `initial_state`: a fresh run starts from this state instead of the model's
        parameters (a resume still wins over it); `settings`: the sections of `arguments`,
        when a task trainer has built them already."""
        if model is None:
            raise ArgumentError("Trainer needs a model: Trainer(arguments=..., model=...).")
        self.arguments = args = arguments if arguments is not None else TrainingArguments()
        # The run's sections, built once: the parts below read these, not the arguments.
        self.settings = settings = settings or RunSettings.from_arguments(args)
        self.processing_class, self.data_collator = processing_class, data_collator
        self.callbacks = list(callbacks or [])
        self.should_stop = False
        # The start, in order: the environment exists before any model array does (a
        # ModelFactory is created already sharded: no host holds the whole model); the data
        # is checked before anything compiles; the optimizer needs the run's length.
        self.runtime = runtime_for(args, runtime, devices)
        self.sharding_plan, self.mesh = self.runtime.plan, self.runtime.mesh
        self.model_parts = parts = ModelParts.adopt(model, settings.model)
        self.model, self.model_config = parts.model, parts.config
        self.num_parameters = parts.num_parameters
        self.pad_token_id = resolve_pad_token_id(processing_class, self.model_config)
        self._featurizer = featurizer or self.create_featurizer
        self.dataset_train, self.dataset_eval = dataset_train, dataset_eval
        self.eval_loader = self._eval_loader(dataset_eval)
        self.task_suite = self._task_suite()  # eval_tasks: checked and loaded now
        self.train_source = self._train_source(dataset_train, train_source)
        default_loss = (
            objective is None and type(self).compute_loss_sums is Trainer.compute_loss_sums
        )
        objective = self._objective(objective)
        names = getattr(self.train_source, "source_names", None)
        if names:  # a mixture: each source's share (and loss, for the default LM loss)
            objective = mixture_objective(objective, names, lm_rows=default_loss)
        self.monitor = RunMonitor(  # trackers, throughput/MFU, compiles, report
            settings.monitor,
            model_config=self.model_config,
            num_parameters=self.num_parameters,
            num_devices=self.mesh.size,
            compiler_options=self.runtime.compiler_options,
            perplexity=objective.token_nll,
            batch_unit=objective.batch_unit,
            differences=objective.differences,
        )
        schedule_length = self._schedule_length()
        # A subclass's optimizer, or the arguments' own built by the Program with its numbers
        # (learning rate, weight decay, ...) an input of the step: one compile serves them all.
        own_optimizer = type(self).create_optimizer is not Trainer.create_optimizer
        self.program = Program(
            parts,
            self.runtime,
            settings,
            schedule_length=schedule_length,
            objective=objective,
            optimizer=self.create_optimizer(schedule_length) if own_optimizer else None,
            jit=self.monitor.jit,
        )
        # Where train() starts, its saves, keep-N, the run's files.
        self.checkpoints = RunCheckpointer(
            settings.checkpoint,
            args,
            self.program,
            self.train_source,
            self.monitor,
            on_save=lambda path, step: self.hooks.call("on_save", self, path, step),
            tokenizer=processing_class,
            initial_state=initial_state,
            trainer_class=type(self),
        )
        self._evaluator = None  # created at the first evaluation
        self._task_model = None  # eval_tasks' JaxLM, created at the first evaluation

    # ------------------------------------------------------------------ setup
    def _train_source(self, dataset: Any, given: BatchSource | None) -> BatchSource | None:
        """The train batches: a task's own source, or the loader of `dataset`."""
        if given is not None:
            return given
        if dataset is None:
            return None
        settings, layout = self.settings.data, self.sharding_plan.batch
        if isinstance(dataset, Mapping):  # {name: source}: a weighted mixture
            loader = build_mixture_loader(settings, dataset, **self._data())
        elif settings.mixture_stages is not None:
            raise ArgumentError(
                "TrainingArguments.mixture_weights is set but dataset_train is one dataset; "
                "pass the sources as a mapping, dataset_train={'web': ..., 'code': ...}."
            )
        else:
            loader = build_train_loader(settings, dataset, **self._data())
        layout.check(settings.micro_batch_size, settings.seq_len, "micro-batch size")
        return LoaderSource(loader, layout, prefetch_batches=settings.prefetch_batches)

    def _eval_loader(self, dataset: Any) -> Any:
        if dataset is None:
            return None
        settings = self.settings.data
        self.sharding_plan.batch.check(
            settings.eval_batch_size, settings.seq_len, "eval_batch_size"
        )
        return build_eval_loader(settings, dataset, **self._data())

    def _task_suite(self) -> Any:
        """The lm-eval tasks of `eval_tasks` (evaluation/harness.py): their files and data
        checked, their documents read, before anything compiles; None without tasks."""
        loop, data = self.settings.loop, self.settings.data
        if not loop.eval_tasks:
            return None
        if self.processing_class is None:
            raise TaskError(
                "TrainingArguments.eval_tasks are text tasks: pass the tokenizer as "
                "Trainer(processing_class=...)."
            )
        if self.runtime.process_count > 1:
            raise TaskError(
                "TrainingArguments.eval_tasks run on one process for now; evaluate the run's "
                "checkpoints with `jaxtrain evaluate` instead."
            )
        self.sharding_plan.batch.check(data.eval_batch_size, data.seq_len, "eval_batch_size")
        return TaskSuite(loop.eval_tasks, limit=loop.eval_tasks_limit)

    def _data(self) -> dict[str, Any]:
        """What the loaders take besides the data settings."""
        return dict(
            # Each process reads only its share of every batch: [A, M // process_count, T].
            process_index=self.runtime.process_index,
            process_count=self.runtime.process_count,
            pad_token_id=self.pad_token_id,
            tokenizer=self.processing_class,
            collator=self.data_collator,
            featurizer=self._featurizer,
            # Token ids are checked against the model's vocabulary (the whole of a map-style
            # dataset now, streams row by row as read).
            vocab_size=getattr(self.model_config, "vocab_size", None),
        )

    def _schedule_length(self) -> int:
        """The schedule's length in updates. Without training data (eval or sampling only) it
        is moot: it does not change the optimizer state's structure."""
        if self.train_source is None:
            return max(self.settings.loop.max_steps, 1)
        steps = self.settings.loop.total_steps(
            self.train_source.steps_per_epoch
        )  # with epochs, known only now that the data is
        check_warmup(self.settings.optimizer, steps, "num_train_epochs x steps per epoch")
        return steps

    # ---------------------------------------------- what a subclass may change
    def create_featurizer(self, name: str) -> Any:
        """The Featurizer turning `name`'s rows into examples; None: the default (text,
        messages or input_ids)."""
        del name
        return None

    def compute_loss_sums(self, model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array):
        """Sums over one micro-batch of the task's objective (the causal LM loss for a plain
        Trainer, DPO's for a DPOTrainer, on the model its program trains): "loss_sum" and
        "tokens" at least, every other key logged (jaxtrain/objective.py). A subclass that
        overrides it replaces the objective's loss."""
        return self._task_objective.loss_sums(model, batch, rng)

    def loss_normalizer(self, batch: dict[str, jax.Array]) -> jax.Array:
        """What the loss sum of a whole global batch is divided by (target tokens for the
        causal LM loss, pairs for a preference loss)."""
        return self._task_objective.normalizer(batch)

    def _objective(self, given: Objective | None) -> Objective:
        """The run's one objective: the task's (`given`; else the causal LM loss), with a
        subclass's `compute_loss_sums` / `loss_normalizer` in its place when it overrides
        them, whichever way the task stated its own."""
        self._task_objective = given or Objective(
            loss_sums=causal_lm_loss_sums,
            normalizer=count_target_tokens,
            token_nll=self.loss_is_token_nll,
            batch_unit=self.batch_unit,
        )
        overrides: dict[str, Any] = {}
        if type(self).compute_loss_sums is not Trainer.compute_loss_sums:
            overrides["loss_sums"] = self.compute_loss_sums
        if type(self).loss_normalizer is not Trainer.loss_normalizer:
            overrides["normalizer"] = self.loss_normalizer
        return dataclasses.replace(self._task_objective, **overrides)

    def create_optimizer(self, total_steps: int) -> tuple[Any, Callable[[Any], Any]]:
        """(optax transformation, learning-rate schedule) over `total_steps` updates: the
        arguments' optimizer for the model's parameters (`model_parts.params`). Override it
        for an optimizer of your own; its numbers are then constants of the train step, where
        the arguments' own are an input (a new learning rate compiles nothing)."""
        params = self.model_parts.params
        return run_optimizer(
            self.settings.optimizer,
            total_steps,
            params,
            logical_axes=param_logical_axes(params),
            mesh=self.mesh,
        )

    # ------------------------------------------------------------ the state
    def create_state(self, *, copy: bool = True) -> TrainState:
        """A fresh state on the mesh from the model's parameters (Program.create_state)."""
        return self.program.create_state(copy=copy)

    def load_checkpoint(self, path: str | Path) -> TrainState:
        """Restore a TrainState written by this kind of Trainer (same model and optimizer).

        `path` is a step directory or a run directory (its newest committed checkpoint).
        """
        return self.checkpoints.load(path)

    def model_from_state(self, state: TrainState) -> nnx.Module:
        """A model object carrying `state`'s parameters (for sampling, export, ...)."""
        return self.program.model_from_state(state)

    def save_pretrained(
        self,
        state: TrainState,
        save_directory: str | Path,
        *,
        lora_format: str = "merged",
        **kwargs: Any,
    ) -> Path:
        """Export `state` as a Hugging Face directory (weights, config, tokenizer, model card).

        kwargs go to `jaxtrain.hf.save_pretrained` (max_shard_size, dtype, tokenizer).
        With LoRA, `lora_format="merged"` folds the adapters into the base weights (a plain
        model); "peft" writes a PEFT adapter directory (adapter_config.json and
        adapter_model.safetensors) for the base model instead.
        """
        from jaxtrain.hf.model_card import training_summary
        from jaxtrain.hf.save import save_program_state

        kwargs.setdefault("tokenizer", self.processing_class)
        # The template the run rendered its conversations with (None: the tokenizer's own).
        kwargs.setdefault("chat_template", self.settings.data.chat_template)
        if lora_format == "merged":
            summary = training_summary(
                self.settings.monitor, self.model, state, self.dataset_train, self.dataset_eval
            )
            kwargs["training_summary"] = {**summary, **kwargs.get("training_summary", {})}
        return save_program_state(
            self.program, state, save_directory, lora_format=lora_format, **kwargs
        )

    def dry_run(self) -> str:
        """Print (process 0) and return mesh, per-device memory and every param's sharding."""
        report = dry_run_report(self.program, self.settings.data)
        if jax.process_index() == 0:
            print(report)
        return report

    # ------------------------------------------------------------------ train
    def add_hook(self, hook: Any, *, every: int | None = None) -> None:
        """Register a callback (an object with any of the TrainerCallback hooks, hooks.py) or
        a function called as `on_step_end(trainer, state, metrics, step)`.

        `every=N`: its per-step hooks run only at steps that are multiples of N (see
        hooks.py). It runs after the Trainer's own hooks and `callbacks`, in order added.
        """
        self.callbacks.append(ScheduledHook(hook, every))

    @property
    def hooks(self) -> HookSet:
        """Who receives the run's hooks, in order: this Trainer (a subclass's overrides),
        then `callbacks` (and `add_hook`s). The monitor is called by the loop after them."""
        return HookSet([self, *self.callbacks])

    def train(self) -> TrainerOutput:
        """Train to the last step, or until a hook, a signal or the time limit stops the run.

        Resumes from output_dir's newest checkpoint (resume_if_possible) or resume_from.
        SIGINT/SIGTERM: the step in flight finishes, a checkpoint is saved, and
        TrainingInterrupted is raised. NaN/Inf losses follow `on_nan`.
        """
        if self.train_source is None:
            raise ArgumentError("Trainer.train() needs dataset_train.")
        self._check_arguments_unchanged()
        self.should_stop = False  # a hook's stop ended the last call, not this one
        return TrainingLoop(self).run()

    def _check_arguments_unchanged(self) -> None:
        """The run was built from its arguments' sections: a field set on `trainer.arguments`
        since then would be silently ignored, so it is an error that names it."""
        now, then = self.arguments.to_dict(), self.settings.monitor.config
        changed = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
        if changed:
            detail = ", ".join(f"{k}={then.get(k)!r} -> {now.get(k)!r}" for k in changed)
            raise ArgumentError(
                f"trainer.arguments changed after the Trainer was built ({detail}); the run "
                "is built from the arguments it was given. Build a new Trainer with these "
                "arguments instead."
            )

    # ------------------------------------------------------------------- eval
    def eval(self, state: TrainState, max_batches: int | None = None) -> Iterator[dict[str, float]]:
        """Evaluate on dataset_eval; yields running token-weighted metrics after each batch.

        The last yielded dict covers the whole eval set (or `max_batches` batches; None: the
        arguments' max_eval_batches).
        """
        if self.eval_loader is None:
            raise ArgumentError("Trainer.eval() needs dataset_eval.")
        if self._evaluator is None:
            self._evaluator = self.program.evaluator()
        prefetched = eval_global_batches(
            self.eval_loader, self.sharding_plan.batch, self.settings.data.prefetch_batches
        )
        try:
            batches = (global_batch for _, global_batch in prefetched)
            limit = self.settings.loop.max_eval_batches if max_batches is None else max_batches
            yield from self._evaluator.run(state.params, batches, limit)
        finally:
            prefetched.close()  # an evaluation cut short by max_eval_batches stops its reader

    @property
    def evaluates(self) -> bool:
        """Whether an evaluation has anything to do: an eval set, or eval_tasks."""
        return self.eval_loader is not None or self.task_suite is not None

    def evaluate(self, state: TrainState, max_batches: int | None = None) -> dict[str, float]:
        """Metrics over the whole eval set (the last value `eval` yields; `max_batches` as
        there), and every eval task's scores with their standard errors
        (`eval/<task>/<metric>`)."""
        if not self.evaluates:
            raise ArgumentError("Trainer.evaluate() needs dataset_eval or eval_tasks.")
        metrics: dict[str, float] = {}
        if self.eval_loader is not None:
            for metrics in self.eval(state, max_batches):  # noqa: B007 - the last: all of it
                pass
        if self.task_suite is not None:
            metrics = {**metrics, **self.evaluate_tasks(state)}
        return metrics

    def evaluate_tasks(self, state: TrainState) -> dict[str, float]:
        """The eval_tasks' scores of `state`'s model: lm-eval's requests answered by the
        live parameters (evaluation/lm.py: compiled scoring, the serving engine), batched by
        eval_batch_size on the run's mesh."""
        from jaxtrain.evaluation.lm import JaxLM  # lm-eval: only runs with eval_tasks

        model = self.model_from_state(state)
        if self._task_model is None:
            layout = self.sharding_plan.batch
            rows = layout.spec(1, micro_axis=False)  # rows over the batch axes, nothing else

            def sharding(ndim: int) -> NamedSharding:
                return NamedSharding(layout.mesh, PartitionSpec(*rows, *[None] * (ndim - 1)))

            self._task_model = JaxLM(
                model,
                self.processing_class,
                batch_size=self.settings.data.eval_batch_size,
                sharding=sharding,
            )
        else:
            self._task_model.update(model)
        return self.task_suite.evaluate(self._task_model)
