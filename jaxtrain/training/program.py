"""A Program: what it takes to compile and run one step, and nothing else.

The model split into its trained parameters and its frozen rest (a DPO reference, a teacher,
LoRA's base weights), the optimizer, the shardings of the state on the runtime's mesh, the
abstract state, the objective and the compiled train and eval steps. It needs no output
directory, loader, monitor or checkpoint: `jaxtrain plan` compiles a Program's step from
shapes, the Trainer composes one with batch sources, checkpoints, a monitor and hooks, and
export and evaluation take one.

    settings = RunSettings.from_arguments(args)
    parts = ModelParts.adopt(model, settings.model, runtime.plan)
    program = Program(parts, runtime, settings, schedule_length=1000)
    step = program.compile_train_step(program.abstract_state(), abstract_batch)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config.sections import ModelSettings, RunSettings
from jaxtrain.errors import ArgumentError
from jaxtrain.models.elementwise import check_kernel
from jaxtrain.models.frozen import freeze
from jaxtrain.models.layers import Projection
from jaxtrain.models.lora import apply_lora, set_lora_dropout_key
from jaxtrain.models.sharding import with_activation_sharding
from jaxtrain.objective import Difference
from jaxtrain.observability.compiles import TrackedJit
from jaxtrain.parallel import ModelFactory
from jaxtrain.parallel.init import cast_floating, cast_frozen
from jaxtrain.quantization.kernel import KEPT_IN_FLOAT
from jaxtrain.runtime import Runtime
from jaxtrain.state import TrainState
from jaxtrain.training.evaluation import Evaluator
from jaxtrain.training.optim import TunableOptimizer, tunable_optimizer
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
    GlobalScalarsFn,
    StepWithFrozen,
    causal_lm_loss_sums,
    count_target_tokens,
    make_train_step,
)

__all__ = ["ModelParts", "Objective", "Program"]

# jit(fn, name, progress=..., **jit_kwargs) -> TrackedJit: RunMonitor.jit reports compiles.
JitFactory = Callable[..., TrackedJit]


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a step minimises: `loss_sums(model, batch, rng)` -> sums over a micro-batch
    (jaxtrain/objective.py), divided by `normalizer(global batch)`; `token_nll`: the loss is
    a per-token NLL (perplexity is logged); `batch_unit`: "tokens" or "examples";
    `global_scalars(global batch)`: named scalars of the whole batch each micro-batch's
    `loss_sums` reads as `batch[name]` (a per-pair loss with a token-mean term: ORPO);
    `differences`: (name, a, b) logged as a - b of two logged means (jaxtrain/objective.py)."""

    loss_sums: Callable[..., Any] = causal_lm_loss_sums
    normalizer: Callable[[dict[str, jax.Array]], jax.Array] = count_target_tokens
    token_nll: bool = True
    batch_unit: str = "tokens"
    global_scalars: GlobalScalarsFn | None = None
    differences: tuple[Difference, ...] = ()


@dataclasses.dataclass
class ModelParts:
    """A model configured for a run (compute dtype, remat policy, LoRA adapters) and split
    into its graph, its trained parameters and the rest (frozen weights in param_dtype too:
    parallel/init.py cast_frozen).

    `model` is the user's object (changed in place: it receives the run's dtype, remat
    policy and adapters), or a ModelFactory's abstract model (nothing allocated); `factory`
    is then the factory that creates it sharded."""

    model: nnx.Module
    factory: ModelFactory | None
    graphdef: Any
    params: Any  # the initial parameters, or their shapes once a run took the arrays
    rest: Any
    config: Any
    num_parameters: int

    @classmethod
    def adopt(cls, model: nnx.Module | ModelFactory, settings: ModelSettings) -> ModelParts:
        factory = model if isinstance(model, ModelFactory) else None
        if factory is not None and (settings.lora_rank or settings.freeze_vision_tower):
            build = factory.build
            factory = ModelFactory(lambda: adapt(build(), settings))
        if factory is not None:
            model = factory.abstract()  # shapes only; the Program creates it, sharded
        configure_model(model, settings)
        if factory is None:
            check_quantized_base(model, settings)
            # In place: the user's model gains the adapters (its base is quantized if asked).
            adapt(model, settings)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = cast_floating(params, settings.param_dtype)
        rest = cast_frozen(rest, settings.param_dtype)
        return cls(
            model=model,
            factory=factory,
            graphdef=graphdef,
            params=params,
            rest=rest,
            config=getattr(model, "config", None),
            num_parameters=count_parameters(params),
        )


def _check_elementwise_kernels(model: nnx.Module, kernels: str) -> None:
    """Fused kernels where they run and where the model has layers that take them."""
    if kernels == "xla":
        return
    field = "TrainingArguments.elementwise_kernels"
    check_kernel(kernels, field)
    if not any(hasattr(m, "elementwise_kernels") for _, m in nnx.iter_modules(model)):
        raise ArgumentError(f"{field}={kernels!r}: {type(model).__name__} has no layers that "
                            "take fused elementwise kernels (the Llama family's do); use "
                            "'xla'.")  # fmt: skip


def configure_model(model: nnx.Module, settings: ModelSettings) -> None:
    """The run's remat policy, layer scan, float8 matmuls, elementwise kernels and compute
    dtype on `model`, in place."""
    _check_elementwise_kernels(model, settings.elementwise_kernels)
    # Every module with the attribute: a task's frozen reference or teacher, a reward model's
    # backbone and a VLM's language model scan as the trained model does.
    for path, module in nnx.iter_modules(model):
        if hasattr(module, "scan_layers"):
            module.scan_layers = settings.scan_layers
        # The output head stays in the compute dtype (models/fp8.py).
        if isinstance(module, Projection) and path and path[-1] not in KEPT_IN_FLOAT:
            module.fp8 = settings.fp8_matmuls
        if hasattr(module, "elementwise_kernels"):
            module.elementwise_kernels = settings.elementwise_kernels
    if hasattr(model, "remat_policy"):
        model.remat_policy = settings.remat_policy
    elif settings.remat_policy != "none":
        raise ArgumentError(
            f"TrainingArguments.gradient_checkpointing={settings.remat_policy!r} needs a model "
            f"with a `remat_policy` attribute; {type(model).__name__} has none. Use "
            "gradient_checkpointing='none' or add remat support to the model."
        )
    if settings.dtype is not None:
        compute_dtype = jnp.dtype(settings.dtype)
        for _, module in nnx.iter_modules(model):
            if hasattr(module, "dtype"):
                module.dtype = compute_dtype


def check_quantized_base(model: nnx.Module, settings: ModelSettings) -> None:
    """A model whose base was quantized at load (hf.from_pretrained(quantization=...)) trains
    only adapters, and only under the quantization it was loaded with (if one is set)."""
    from jaxtrain.quantization.kernel import QuantizedKernel

    kernels = [m for _, m in nnx.iter_modules(model) if isinstance(m, QuantizedKernel)]
    if not kernels:
        return
    loaded = kernels[0]
    if not settings.lora_rank:
        raise ArgumentError(
            f"the model's base is quantized ({loaded.kind}, loaded with quantization=...): "
            "only LoRA adapters can train on it. Set lora_rank (e.g. 16), or load the model "
            "without quantization for full fine-tuning."
        )
    double = loaded.scales_scale is not None
    wanted = settings.quantization
    if wanted is not None and (
        wanted != loaded.kind
        or (wanted == "nf4" and settings.quantization_block_size != loaded.block)
        or settings.quantization_double != double
    ):
        raise ArgumentError(
            f"TrainingArguments.quantization={wanted!r} (block "
            f"{settings.quantization_block_size}, double={settings.quantization_double}), but "
            f"the model was loaded quantized as {loaded.kind!r} (block {loaded.block}, "
            f"double={double}); set the same, or quantization=None to train on it as loaded."
        )


def quantize(model: nnx.Module, settings: ModelSettings) -> nnx.Module:
    """The frozen base of a LoRA model stored quantized (QLoRA), when the settings ask."""
    if settings.quantization is None:
        return model
    from jaxtrain.quantization import quantize_base

    quantize_base(
        model,
        settings.quantization,
        settings.quantization_block_size,
        double=settings.quantization_double,
    )
    configure_model(model, settings)  # the new kernels dequantize to the compute dtype
    return model


def adapt(model: nnx.Module, settings: ModelSettings) -> nnx.Module:
    """What the run changes in which weights train, in place: a vision-language model's
    frozen vision tower, LoRA adapters (on a quantized base when asked)."""
    if settings.freeze_vision_tower:
        # Each vision-language model names its tower's parts (`vision_tower_parts`: dotted
        # attribute paths; the projector or merger after them is not one).
        towers = [
            functools.reduce(getattr, part.split("."), m)
            for _, m in nnx.iter_modules(model)
            for part in getattr(m, "vision_tower_parts", ())
        ]
        if not towers:
            raise ArgumentError(
                f"TrainingArguments.freeze_vision_tower=True, but {type(model).__name__} has no "
                "vision tower; it applies to vision-language models only."
            )
        for tower in towers:
            freeze(tower)
    if settings.lora_rank:
        quantize(add_lora(model, settings), settings)
    return model


def add_lora(model: nnx.Module, settings: ModelSettings) -> nnx.Module:
    """Adapters on the targeted projections, every other weight frozen (models/lora.py)."""
    apply_lora(  # frozen parts (a reference, a teacher) have no Param kernel to adapt
        model,
        rank=settings.lora_rank,
        alpha=settings.lora_alpha,
        dropout=settings.lora_dropout,
        targets=None if settings.lora_targets is None else list(settings.lora_targets),
        seed=settings.seed,
    )
    return model


class Program:
    """One run's step, compiled on the runtime's mesh (see the module docstring).

    `settings`: the run's sections (config.sections.RunSettings: its model, optimizer and
    pruning are read). `schedule_length` is the number of updates the learning-rate schedule
    spans. `optimizer`: (optax transformation, schedule) in place of the settings' own
    (pruning still wraps it when asked for); the settings' own take their numbers (learning
    rate, weight decay, clipping) as an input of the step, a given one has them as constants.
    """

    def __init__(
        self,
        parts: ModelParts,
        runtime: Runtime,
        settings: RunSettings,
        *,
        schedule_length: int,
        objective: Objective | None = None,
        optimizer: tuple[Any, Callable[[Any], Any]] | None = None,
        jit: JitFactory | None = None,
    ):
        if not isinstance(settings, RunSettings):
            raise ArgumentError(
                f"Program takes the run's sections, not a {type(settings).__name__}: "
                "Program(parts, runtime, RunSettings.from_arguments(args), ...) "
                "(jaxtrain.config.sections)."
            )
        self.parts, self.runtime = parts, runtime
        self.plan, self.mesh = runtime.plan, runtime.mesh
        self.settings = settings.model
        self.objective = objective or Objective()
        self._jit = jit
        self.plan.check_expert_axis(parts.params)  # ep > 1 needs experts
        tunable = (
            TunableOptimizer.fixed(*optimizer)
            if optimizer is not None
            else tunable_optimizer(
                settings.optimizer,
                schedule_length,
                parts.params,
                logical_axes=param_logical_axes(parts.params),
                mesh=runtime.mesh,
            )
        )
        # Masks live in the optimizer state, for any optimizer (pruning.py says why).
        pruning = settings.pruning
        self.tunable = tunable.wrapped(lambda tx: with_pruning(tx, pruning, schedule_length))
        # The run's own numbers as constants: what the state is built from (its structure does
        # not depend on them) and what callers outside the step read.
        self.optimizer, self.schedule = self.tunable()
        self._placed_numbers = None
        self.seed = self.settings.seed
        self._state_shardings = self._state_shape_cache = None
        self._placed_rest = None  # the non-Param state on the mesh (frozen_state())

    # ---------------------------------------------------------------- the model
    @property
    def model(self) -> nnx.Module:
        return self.parts.model

    @property
    def graphdef(self) -> Any:
        return self.parts.graphdef

    @property
    def rest(self) -> Any:
        return self.parts.rest

    def model_from_state(self, state: TrainState) -> nnx.Module:
        """The trained model carrying `state`'s parameters (a task model's trained part)."""
        merged = nnx.merge(self.graphdef, state.params, self.rest)
        return merged.model if hasattr(merged, "frozen_names") else merged

    def return_parameters(self, state: TrainState | None) -> None:
        """The model object gets `state`'s parameters (a fresh start took its arrays)."""
        if state is not None and not any(x.is_deleted() for x in jax.tree.leaves(state.params)):
            nnx.update(self.model, state.params)

    # ---------------------------------------------------------------- the state
    def _new_state(self, params: Any) -> TrainState:
        return TrainState.create(params, self.optimizer)

    @property
    def state_shardings(self) -> TrainState:
        """Shardings of the TrainState on the mesh (params by the rules, optimizer alike)."""
        if self._state_shardings is None:
            self._state_shardings = self.plan.state_shardings(self._state_shapes())
        return self._state_shardings

    def _state_shapes(self) -> TrainState:
        """The state's shapes and dtypes (traced once: the optimizer's init is not free)."""
        if self._state_shape_cache is None:
            self._state_shape_cache = jax.eval_shape(self._new_state, self.parts.params)
        return self._state_shape_cache

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and placement of the state, without allocating it."""
        # Weak types kept: they change dtype promotion, so a step traced from this state is
        # the one the real state would trace.
        return abstract_arrays(self._state_shapes(), self.state_shardings)

    def create_state(self, *, copy: bool = True) -> TrainState:
        """A fresh state on the mesh from the model's parameters.

        `copy=True` gives the state its own arrays, so it outlives a train() (whose steps
        donate their input state). A training run passes `copy=False` for its fresh start:
        the state is built around the model's own arrays, and `return_parameters` gives the
        model the newest ones back."""
        return self.stage_state(copy=copy).run()

    def stage_state(self, *, copy: bool = True) -> StagedBuild | ReadyBuild:
        """`create_state` traced now; its compile (`compile()`, any thread) and its `run()`
        come later, so a run compiles it beside the train step's trace."""
        shardings, options = self.state_shardings, self.runtime.compiler_options
        parts = self.parts
        if parts.factory is not None:  # sharded from birth: one jit, no full copy anywhere
            init = parts.factory.state_and_rest_initializer(
                self._new_state,
                shardings,
                self.plan,
                parts.rest,
                like=parts.params,  # already in param_dtype
                compiler_options=options,
            )

            def keep_rest(outputs: tuple[TrainState, Any]) -> TrainState:
                state, parts.rest = outputs
                self._placed_rest = None
                return state

            return StagedBuild(init, then=keep_rest)
        # The model object's current parameters: its initial ones, or those a run gave back.
        params = cast_floating(nnx.split(self.model, nnx.Param, ...)[1], self.settings.param_dtype)
        params = jax.device_put(params, shardings.params)  # no copy when already placed
        if not copy:  # these arrays are donated: later reads need only their shapes
            parts.params = abstract_arrays(parts.params)
        return stage_state_build(
            self._new_state,
            params,
            shardings,
            take=not copy,
            keep=parts.rest,
            compiler_options=options,
        )

    def placed_state(self, state: TrainState) -> ReadyBuild:
        """A build that places a given state on this Program's shardings (a run that starts
        from a state handed to it, e.g. by Ray's driver), with a clear error when it does not
        fit the model and optimizer."""

        def place() -> TrainState:
            try:
                return jax.device_put(state, self.state_shardings)
            except (ValueError, TypeError) as err:
                raise ArgumentError(
                    "the given state does not fit this run's model and optimizer "
                    f"({err}); pass a state created with the same model, optimizer and "
                    "param_dtype."
                ) from None

        return ReadyBuild(place)

    def frozen_state(self) -> Any:
        """The model's non-Param state (frozen weights, buffers) placed on the mesh by the
        sharding rules, as the jitted steps take it: an argument, never a baked constant."""
        if self._placed_rest is None:
            shardings = self.plan.param_shardings(self.rest)
            self._placed_rest = (jax.device_put(self.rest, shardings), shardings)
        return self._placed_rest[0]

    def optimizer_numbers(self) -> Any:
        """The optimizer's numbers (TunableOptimizer) placed on the mesh, replicated: the train
        step's last argument. Python numbers stay weakly typed there, so the step promotes
        them as it would the constants they replace."""
        if self._placed_numbers is None:
            self._placed_numbers = self.tunable.placed_numbers(self.plan.replicated)
        return self._placed_numbers

    # ---------------------------------------------------------------- the steps
    def jit(self, fn: Callable[..., Any], name: str, *, progress: Any = None, **kw: Any):
        """A TrackedJit of `fn` with the runtime's compiler options (the run's monitor
        reports its compiles when the Program was given its `jit`)."""
        if self._jit is not None:
            return self._jit(fn, name, progress=progress, **kw)
        return TrackedJit(fn, name, compiler_options=self.runtime.compiler_options, **kw)

    def _train_loss_sums(self, model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array):
        """The objective inside the train step: LoRA dropout draws from the step's key."""
        if self.settings.lora_rank and self.settings.lora_dropout > 0:
            set_lora_dropout_key(model, jax.random.fold_in(rng, 0x10AA))
        return self.objective.loss_sums(model, batch, rng)

    def lower_train_step(
        self, state: TrainState, batch: dict[str, jax.Array], progress: Any = None
    ) -> Callable[[], StepWithFrozen]:
        """The train step for `state` and a global `batch` like the ones to come, traced and
        lowered now in the caller's thread (under its JAX settings); the returned function
        runs XLA's compile, in any thread, and returns the step (`state, metrics =
        step(state, batch)`). Both may be abstract (`abstract_state()`, ShapeDtypeStructs)."""
        step_fn = make_train_step(
            graphdef=self.graphdef,
            optimizer=self.tunable,
            seed=self.seed,
            loss_sums_fn=with_activation_sharding(self._train_loss_sums, self.plan.rules),
            normalizer_fn=self.objective.normalizer,
            state_metrics=pruning_metrics,
            global_scalars_fn=self.objective.global_scalars,
        )
        # Compiled ahead of time; a batch of another shape recompiles with a warning naming
        # the changed shapes, and every compile is logged (compiles.py).
        options = self.plan.train_step_jit_options(self.state_shardings, batch)
        rest = self.rest  # a ModelFactory's is abstract until the state exists: shapes suffice
        rest_shardings = self.plan.param_shardings(rest)
        replicated = self.plan.replicated
        options["in_shardings"] = (*options["in_shardings"], rest_shardings, replicated)
        tracked = self.jit(step_fn, "train_step", progress=progress, **options)
        numbers = self.tunable.abstract_numbers(replicated)
        finish = tracked.lower_for(state, batch, abstract_arrays(rest, rest_shardings), numbers)

        def compiled_step() -> StepWithFrozen:
            finish()
            return StepWithFrozen(tracked, lambda: (self.frozen_state(), self.optimizer_numbers()))

        return compiled_step

    def compile_train_step(
        self, state: TrainState, batch: dict[str, jax.Array], progress: Any = None
    ) -> StepWithFrozen:
        """`lower_train_step` and its compile, now."""
        return self.lower_train_step(state, batch, progress)()

    def evaluator(self) -> Evaluator:
        """An Evaluator of the objective over eval batches (compiled at its first batch)."""
        return Evaluator(
            graphdef=self.graphdef,
            rest=self.frozen_state(),
            loss_sums_fn=with_activation_sharding(self.objective.loss_sums, self.plan.rules),
            jit=self.jit,
            perplexity=self.objective.token_nll,
            differences=self.objective.differences,
            global_scalars_fn=self.objective.global_scalars,
        )
