"""The Trainer: a run's model, data, optimizer and checkpoints, in the run's environment.

`__init__` reads top to bottom as the start of a run: the runtime (cluster, mesh, sharding
plan, XLA options: jaxtrain.runtime), the model adopted onto it, the data loaders (checked
before anything compiles), the optimizer, the checkpoints and the monitor. `train()` hands one
run to `loop.TrainingLoop`; the math lives in `step.py` and `logps.py` (pure, jitted), data in
`jaxtrain.data`, sharding in `jaxtrain.parallel`, checkpoints in `jaxtrain.checkpointing` (the
Trainer's side of them, where a run starts, saving and loading, in trainer_checkpoints.py),
and measurements in `jaxtrain.observability`. Subclasses change the objective through
`compute_loss_sums` / `loss_normalizer` (the contract is in jaxtrain/objective.py) and react
to the run through the TrainerCallback hooks.

What the loop uses, and nothing else: `monitor`, `hooks`, `checkpoints`, `plan_start()`,
`stage_state()`, `start_state()`, `abstract_state()`, `lower_train_step()`,
`global_batches()`, `save_checkpoint()`, `evaluate()`, and public attributes (`arguments`,
`model`, `mesh`, `train_loader`, `data_meter`, `should_stop`, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.checkpointing import RunCheckpoints
from jaxtrain.config.checks import check_warmup
from jaxtrain.config.sections import CheckpointSettings, DataSettings, MonitorSettings
from jaxtrain.data import DataMeter, build_eval_loader, build_train_loader, prefetch
from jaxtrain.data.padding import resolve_pad_token_id
from jaxtrain.models.lora import apply_lora, set_lora_dropout_key
from jaxtrain.models.sharding import with_activation_sharding
from jaxtrain.observability.monitor import RunMonitor
from jaxtrain.parallel import ModelFactory
from jaxtrain.parallel.dry_run import dry_run_report
from jaxtrain.parallel.init import cast_floating
from jaxtrain.runtime import Runtime, runtime_for
from jaxtrain.state import TrainState
from jaxtrain.training.evaluation import Evaluator
from jaxtrain.training.hooks import HookSet, ScheduledHook, TrainerCallback
from jaxtrain.training.loop import TrainerOutput, TrainingLoop
from jaxtrain.training.optim import build_optimizer, build_schedule
from jaxtrain.training.pruning import pruning_metrics, with_pruning
from jaxtrain.training.state import (
    ReadyBuild,
    StagedBuild,
    abstract_arrays,
    count_parameters,
    param_logical_axes,
    stage_state_build,
)
from jaxtrain.training.step import (
    StepWithFrozen,
    causal_lm_loss_sums,
    count_target_tokens,
    make_train_step,
)
from jaxtrain.training.trainer_checkpoints import TrainerCheckpoints

__all__ = ["Trainer", "TrainerOutput", "param_logical_axes"]


class Trainer(TrainerCheckpoints, TrainerCallback):
    """Train a Flax NNX causal LM (or any module returning logits) on a dataset.

    Subclasses may override `compute_loss_sums` / `loss_normalizer` for another objective and
    any hook of TrainerCallback.

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
    ):
        """`runtime`: the run's environment (cluster, mesh and plan, XLA options), built from
        `arguments` over `devices` (default all) when not given."""
        if model is None:
            raise ArgumentError("Trainer needs a model: Trainer(arguments=..., model=...).")
        self.arguments = args = arguments if arguments is not None else TrainingArguments()
        self.processing_class, self.data_collator = processing_class, data_collator
        self.callbacks = list(callbacks or [])
        self.should_stop = False
        # The start, in order: the environment exists before any model array does (a
        # ModelFactory is created already sharded: no host holds the whole model); the data
        # is checked before anything compiles; the optimizer needs the run's length.
        self.runtime = runtime_for(args, runtime, devices)
        self.sharding_plan, self.mesh = self.runtime.plan, self.runtime.mesh
        self._adopt_model(model)
        self.pad_token_id = self._resolve_pad_token_id()
        self._build_loaders(dataset_train, dataset_eval)
        self.optimizer, self.schedule = self.create_optimizer(self._schedule_length())
        # Masks live in the optimizer state, for any optimizer (pruning.py says why).
        self.optimizer = with_pruning(self.optimizer, args, self._schedule_length())
        # Where train() starts, its saves, keep-N.
        self.checkpoints = RunCheckpoints(CheckpointSettings.from_arguments(args))
        self.monitor = self._create_monitor()  # trackers, throughput/MFU, compiles, report

    # ------------------------------------------------------------------ setup
    def _adopt_model(self, model: nnx.Module | ModelFactory) -> None:
        """The model (or a ModelFactory's abstract one) configured for this run and split
        into graph definition, parameters and the rest."""
        self._state_shardings = self._state_shape_cache = None
        self._placed_rest = None  # the non-Param state on the mesh (frozen_state())
        self._evaluator = None  # created at the first evaluation
        self._factory = model if isinstance(model, ModelFactory) else None
        if self._factory is not None and self.arguments.lora_rank:
            build = self._factory.build
            self._factory = ModelFactory(lambda: self._apply_lora(build()))
        if self._factory is not None:
            model = self._factory.abstract()  # shapes only; create_state makes it, sharded
        self.model = model
        self.model_config = getattr(model, "config", None)
        self._configure_model(model)
        self.sharding_plan.check_expert_axis(self._initial_params)  # ep > 1 needs experts

    def _build_loaders(self, dataset_train: Any, dataset_eval: Any) -> None:
        """The train and eval loaders; datasets are checked now, before anything compiles."""
        args, layout = self.arguments, self.sharding_plan.batch
        self.dataset_train, self.dataset_eval = dataset_train, dataset_eval
        self.data_settings = DataSettings.from_arguments(args)
        data = dict(
            # Each process reads only its share of every batch: [A, M // process_count, T].
            process_index=self.runtime.process_index,
            process_count=self.runtime.process_count,
            pad_token_id=self.pad_token_id,
            tokenizer=self.processing_class,
            collator=self.data_collator,
            featurizer=self.create_featurizer,
            # Token ids are checked against the model's vocabulary (the whole of a map-style
            # dataset now, streams row by row as read).
            vocab_size=getattr(self.model_config, "vocab_size", None),
        )
        self.train_loader = self.eval_loader = None
        if dataset_train is not None:
            self.train_loader = build_train_loader(self.data_settings, dataset_train, **data)
            layout.check(args.micro_batch_size, args.max_sequence_length, "micro-batch size")
        if dataset_eval is not None:
            layout.check(args.resolved_eval_batch_size, args.max_sequence_length, "eval_batch_size")
            self.eval_loader = build_eval_loader(self.data_settings, dataset_eval, **data)
        self.data_meter = DataMeter()

    def _schedule_length(self) -> int:
        """The schedule's length in updates. Without training data (eval or sampling only) it
        is moot: it does not change the optimizer state's structure."""
        if self.train_loader is None:
            return max(self.arguments.max_steps, 1)
        steps = self.total_steps  # with epochs, known only now that the data is
        check_warmup(self.arguments, steps, "num_train_epochs x steps per epoch")
        return steps

    def _create_monitor(self) -> RunMonitor:
        return RunMonitor(
            MonitorSettings.from_arguments(self.arguments),
            model_config=self.model_config,
            num_parameters=self.num_parameters,
            num_devices=self.mesh.size,
            compiler_options=self.runtime.compiler_options,
            perplexity=self.loss_is_token_nll,
            batch_unit=self.batch_unit,
        )

    def _configure_model(self, model: nnx.Module) -> None:
        args = self.arguments
        if hasattr(model, "remat_policy"):
            model.remat_policy = args.gradient_checkpointing
        elif args.gradient_checkpointing != "none":
            raise ArgumentError(
                f"TrainingArguments.gradient_checkpointing={args.gradient_checkpointing!r} "
                f"needs a model with a `remat_policy` attribute; {type(model).__name__} has "
                "none. Use gradient_checkpointing='none' or add remat support to the model."
            )
        if args.dtype is not None:
            compute_dtype = jnp.dtype(args.dtype)
            for _, module in nnx.iter_modules(model):
                if hasattr(module, "dtype"):
                    module.dtype = compute_dtype
        if args.lora_rank and self._factory is None:
            self._apply_lora(model)  # in place: the user's model gains the adapters
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        params = cast_floating(params, args.param_dtype)
        self._initial_params = params
        self.num_parameters = count_parameters(params)

    def _apply_lora(self, model: nnx.Module) -> nnx.Module:
        """Adapters on the targeted projections, every other weight frozen (models/lora.py)."""
        args = self.arguments
        apply_lora(  # frozen parts (a reference, a teacher) have no Param kernel to adapt
            model,
            rank=args.lora_rank,
            alpha=args.lora_alpha,
            dropout=args.lora_dropout,
            targets=args.lora_targets,
            seed=args.seed,
        )
        return model

    def _resolve_pad_token_id(self) -> int:
        # pad, else eos with a warning; a tokenizer with neither is an ArgumentError.
        return resolve_pad_token_id(self.processing_class, self.model_config)

    def create_featurizer(self, name: str) -> Any:
        """The Featurizer turning `name`'s rows into examples; None: the default (text,
        messages or input_ids). Task trainers return their own (preference pairs, ...)."""
        del name
        return None

    def _train_loss_sums(self, model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array):
        """compute_loss_sums inside the train step: LoRA dropout draws from the step's key."""
        if self.arguments.lora_rank and self.arguments.lora_dropout > 0:
            set_lora_dropout_key(model, jax.random.fold_in(rng, 0x10AA))
        return self.compute_loss_sums(model, batch, rng)

    def compute_loss_sums(self, model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array):
        """Sums over one micro-batch: "loss_sum" and "tokens" at least, every other key
        logged (the contract and the logging rule are in jaxtrain/objective.py)."""
        return causal_lm_loss_sums(model, batch, rng)

    def loss_normalizer(self, batch: dict[str, jax.Array]) -> jax.Array:
        """What the loss sum of a whole global batch is divided by (target tokens)."""
        return count_target_tokens(batch)

    def create_optimizer(self, total_steps: int):
        """Returns (optax transformation, learning-rate schedule)."""
        args = self.arguments
        schedule = build_schedule(
            args.scheduler,
            learning_rate=args.learning_rate,
            total_steps=total_steps,
            warmup_steps=args.warmup_steps,
            min_lr_ratio=args.min_lr_ratio,
            wsd_decay_fraction=args.wsd_decay_fraction,
        )
        optimizer = build_optimizer(
            args.optimizer,
            schedule,
            self._initial_params,
            weight_decay=args.weight_decay,
            clip_grad=args.clip_grad,
            b1=args.adam_beta1,
            b2=args.adam_beta2,
            eps=args.adam_epsilon,
            momentum=args.momentum,
            logical_axes=param_logical_axes(self._initial_params),
        )
        return optimizer, schedule

    @property
    def total_steps(self) -> int:
        if self.train_loader is None:
            raise ArgumentError("Trainer.train() needs dataset_train.")
        return self.arguments.total_steps(self.train_loader.steps_per_epoch)

    def _new_state(self, params: Any) -> TrainState:
        return TrainState.create(params, self.optimizer)

    @property
    def state_shardings(self) -> TrainState:
        """Shardings of the TrainState on `self.mesh` (params by the rules, optimizer alike)."""
        if self._state_shardings is None:
            self._state_shardings = self.sharding_plan.state_shardings(self._state_shapes())
        return self._state_shardings

    def _state_shapes(self) -> TrainState:
        """The state's shapes and dtypes (traced once: the optimizer's init is not free)."""
        if self._state_shape_cache is None:
            self._state_shape_cache = jax.eval_shape(self._new_state, self._initial_params)
        return self._state_shape_cache

    def create_state(self, *, copy: bool = True) -> TrainState:
        """A fresh state on the mesh from the model's parameters.

        `copy=True` (the default) gives the state its own arrays, so it outlives `train()`
        (whose steps donate their input state). `train()` passes `copy=False` for its fresh
        start: the state is built around the model's own arrays, so no second copy of the
        parameters exists; the model object gets the newest parameters back when `train()`
        returns or fails. To start from something else, override `stage_state`.
        """
        return self.stage_state(copy=copy).run()

    def stage_state(self, *, copy: bool = True) -> StagedBuild | ReadyBuild:
        """`create_state` traced now; its compile (`compile()`, any thread) and its `run()`
        come later. `train()` compiles it beside the train step's trace. A subclass that
        starts from other arrays returns a `ReadyBuild` (training/state.py)."""
        shardings, options = self.state_shardings, self.runtime.compiler_options
        if self._factory is not None:  # sharded from birth: one jit, no full copy anywhere
            init = self._factory.state_and_rest_initializer(
                self._new_state,
                shardings,
                self.sharding_plan,
                self.rest,
                like=self._initial_params,  # already in param_dtype (_configure_model)
                compiler_options=options,
            )

            def keep_rest(outputs: tuple[TrainState, Any]) -> TrainState:
                state, self.rest = outputs
                self._placed_rest = None
                return state

            return StagedBuild(init, then=keep_rest)
        # The model object's current parameters: its initial ones, or those a train() gave
        # back after taking them.
        params = cast_floating(nnx.split(self.model, nnx.Param, ...)[1], self.arguments.param_dtype)
        params = jax.device_put(params, shardings.params)  # no copy when already placed
        if not copy:  # these arrays are donated: later reads need only their shapes
            self._initial_params = abstract_arrays(self._initial_params)
        return stage_state_build(
            self._new_state,
            params,
            shardings,
            take=not copy,
            keep=self.rest,
            compiler_options=options,
        )

    def frozen_state(self) -> Any:
        """The model's non-Param state (frozen weights, buffers) placed on the mesh by the
        sharding rules, as the jitted steps take it: an argument, never a baked constant."""
        if self._placed_rest is None:
            shardings = self.sharding_plan.param_shardings(self.rest)
            self._placed_rest = (jax.device_put(self.rest, shardings), shardings)
        return self._placed_rest[0]

    def dry_run(self) -> str:
        """Print (process 0) and return mesh, per-device memory and every param's sharding."""
        report = dry_run_report(self)
        if jax.process_index() == 0:
            print(report)
        return report

    def model_from_state(self, state: TrainState) -> nnx.Module:
        """A model object carrying `state`'s parameters (for sampling, export, ...)."""
        return nnx.merge(self.graphdef, state.params, self.rest)

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
        from jaxtrain.hf.save import save_trainer_state

        return save_trainer_state(self, state, save_directory, lora_format=lora_format, **kwargs)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and placement of this Trainer's state, without allocating it."""
        # Weak types kept: they change dtype promotion, so a step traced from this state is
        # the one the real state would trace.
        return abstract_arrays(self._state_shapes(), self.state_shardings)

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
        `callbacks` (and `add_hook`s), then the monitor."""
        return HookSet([self, *self.callbacks, self.monitor])

    def train(self) -> TrainerOutput:
        """Train to the last step, or until a hook, a signal or the time limit stops the run.

        Resumes from output_dir's newest checkpoint (resume_if_possible) or resume_from.
        SIGINT/SIGTERM: the step in flight finishes, a checkpoint is saved, and
        TrainingInterrupted is raised. NaN/Inf losses follow `on_nan`.
        """
        return TrainingLoop(self).run()

    def compile_train_step(
        self, state: TrainState, batch: dict[str, jax.Array], progress: Any = None
    ) -> Any:
        """The jitted train step for `state` and a global `batch` like the ones to come,
        compiled now (the caller owns it: `state, metrics = step(state, batch)`). Both may be
        abstract (`abstract_state()`, ShapeDtypeStructs): nothing is read or placed. Compiles
        are reported through the monitor; `progress` shows that one is under way."""
        return self.lower_train_step(state, batch, progress)()

    def lower_train_step(
        self, state: TrainState, batch: dict[str, jax.Array], progress: Any = None
    ) -> Callable[[], Any]:
        """`compile_train_step` in two parts: the trace and lowering happen now, in the
        caller's thread (under its JAX settings); the returned function runs XLA's compile,
        in any thread, and returns the step. The loop compiles while it builds the state."""
        step_fn = make_train_step(
            graphdef=self.graphdef,
            optimizer=self.optimizer,
            schedule=self.schedule,
            seed=self.arguments.seed,
            loss_sums_fn=with_activation_sharding(self._train_loss_sums, self.sharding_plan.rules),
            normalizer_fn=self.loss_normalizer,
            state_metrics=pruning_metrics,
        )
        # Compiled ahead of time; a batch of another shape recompiles with a warning naming
        # the changed shapes, and every compile is logged (compiles.py).
        options = self.sharding_plan.train_step_jit_options(self.state_shardings, batch)
        rest = self.rest  # a ModelFactory's is abstract until create_state: shapes suffice
        rest_shardings = self.sharding_plan.param_shardings(rest)
        options["in_shardings"] = (*options["in_shardings"], rest_shardings)
        tracked = self.monitor.jit(step_fn, "train_step", progress=progress, **options)
        finish = tracked.lower_for(state, batch, abstract_arrays(rest, rest_shardings))

        def compiled_step() -> StepWithFrozen:
            finish()
            return StepWithFrozen(tracked, self.frozen_state)

        return compiled_step

    # ------------------------------------------------------------------- eval
    def eval(self, state: TrainState) -> Iterator[dict[str, float]]:
        """Evaluate on dataset_eval; yields running token-weighted metrics after each batch.

        The last yielded dict covers the whole eval set (or max_eval_batches batches).
        """
        if self.dataset_eval is None:
            raise ArgumentError("Trainer.eval() needs dataset_eval.")
        args = self.arguments
        if self._evaluator is None:
            self._evaluator = Evaluator(
                graphdef=self.graphdef,
                rest=self.frozen_state(),
                loss_sums_fn=with_activation_sharding(
                    self.compute_loss_sums, self.sharding_plan.rules
                ),
                jit=self.monitor.jit,
                perplexity=self.loss_is_token_nll,
            )
        host_batches = ((batch, None) for batch in self.eval_loader.batches())
        prefetched = self.global_batches(host_batches, micro_axis=False)
        try:
            batches = (global_batch for (_, global_batch), _ in prefetched)
            yield from self._evaluator.run(state.params, batches, args.max_eval_batches)
        finally:
            prefetched.close()  # an evaluation cut short by max_eval_batches stops its reader

    def global_batches(self, host_batches: Iterable[tuple[Any, Any]], *, micro_axis: bool):
        """The one path from a loader to the mesh, for train and eval batches alike.

        Each (host batch, extra) becomes ((host batch, global batch), extra); the global
        batch is assembled on the mesh (each host gives only its rows) in a background
        thread `prefetch_batches` ahead. Returns the Prefetcher: close() it when done early.
        """
        layout = self.sharding_plan.batch

        def placed():
            for host_batch, extra in host_batches:
                yield (host_batch, layout.to_global(host_batch, micro_axis=micro_axis)), extra

        return prefetch(placed(), size=self.arguments.prefetch_batches)

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """Metrics over the whole eval set (the last value `eval` yields)."""
        metrics: dict[str, float] = {}
        for metrics in self.eval(state):  # noqa: B007 - the last yield covers the whole set
            pass
        return metrics
