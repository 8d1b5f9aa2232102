"""The frozen sections of a run's configuration: what each subsystem reads, and nothing else.

The flat `TrainingArguments` (YAML, CLI, seed names) is what users write; each subsystem takes
its section, built here from the arguments in one place. A section has no defaults of its
own: every value comes from the arguments, so the two can never disagree.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Self

from jaxtrain.config.mixture import Stages, parse_mixture_weights

__all__ = [
    "CheckpointSettings",
    "DataSettings",
    "LoopSettings",
    "ModelSettings",
    "MonitorSettings",
    "OptimizerSettings",
    "PruningSettings",
    "RunSettings",
    "RuntimeSettings",
    "task_settings",
]


class SameNamedFields:
    """A section whose fields are the arguments' fields of the same names: from_arguments
    copies them (a section given is returned as it is)."""

    @classmethod
    def from_arguments(cls, args: Any) -> Self:
        if isinstance(args, cls):
            return args
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class OptimizerSettings(SameNamedFields):
    """The optimizer and its learning-rate schedule (training/optim.py)."""

    optimizer: str
    scheduler: str
    learning_rate: float
    warmup_steps: int
    min_lr_ratio: float
    wsd_decay_fraction: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    momentum: float
    clip_grad: float | None
    mu_dtype: str | None


@dataclasses.dataclass(frozen=True)
class PruningSettings:
    """Gradual magnitude pruning (training/pruning.py); target_sparsity 0 is off."""

    target_sparsity: float
    begin_step: int
    end_step: int | None
    frequency: int
    targets: tuple[str, ...] | None

    @classmethod
    def from_arguments(cls, args: Any) -> PruningSettings:
        if isinstance(args, cls):
            return args
        return cls(
            target_sparsity=args.pruning_target_sparsity,
            begin_step=args.pruning_begin_step,
            end_step=args.pruning_end_step,
            frequency=args.pruning_frequency,
            targets=None if args.pruning_targets is None else tuple(args.pruning_targets),
        )


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """How the run holds and computes the model: precision, remat, LoRA, the seed of its
    randomness (LoRA's initial adapters and dropout)."""

    dtype: str | None
    param_dtype: str | None
    remat_policy: str  # gradient_checkpointing
    scan_layers: bool
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_targets: tuple[str, ...] | None  # None: every group the model has
    seed: int
    quantization: str | None  # the frozen base stored as "nf4" or "int8" (QLoRA)
    quantization_block_size: int
    quantization_double: bool
    freeze_vision_tower: bool = False  # a vision-language model's image encoder stays as is
    fp8_matmuls: bool = False  # the decoder layers' projections in float8 (models/fp8.py)
    elementwise_kernels: str = "xla"  # the layers' elementwise work (models/elementwise.py)

    @classmethod
    def from_arguments(cls, args: Any) -> ModelSettings:
        if isinstance(args, cls):
            return args
        return cls(
            dtype=args.dtype,
            param_dtype=args.param_dtype,
            remat_policy=args.gradient_checkpointing,
            # Unset: under scan where it saves memory (a quantized base: bench/RESULTS.md).
            scan_layers=args.quantization is not None
            if args.scan_layers is None
            else args.scan_layers,
            fp8_matmuls=args.fp8_matmuls,
            elementwise_kernels=args.elementwise_kernels,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            lora_targets=None if args.lora_targets is None else tuple(args.lora_targets),
            seed=args.seed,
            quantization=args.quantization,
            quantization_block_size=args.quantization_block_size,
            quantization_double=args.quantization_double,
            freeze_vision_tower=args.freeze_vision_tower,
        )


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """What the data pipeline reads of a run's arguments, and nothing else."""

    seq_len: int  # max_sequence_length
    global_batch_size: int  # total_batch_size: rows of one update, over every host
    accumulation_steps: int  # gradient_accumulation_steps
    eval_batch_size: int  # eval_batch_size, default the micro-batch size
    seed: int
    shuffle: bool  # shuffle_train
    drop_last: bool
    truncation_mode: str
    packing: bool
    packing_window: int
    split_long_documents: bool
    streaming: bool
    stream_window: int
    # The run's length is fixed by max_steps (else by epochs of the data).
    fixed_length: bool
    epoch_evaluation: bool  # evaluation_strategy == "epoch"
    # Featurizing rows: columns, chat template, which tokens carry a loss.
    text_column: str
    messages_column: str
    completion_only_loss: bool
    chat_template: str | None
    drop_columns: tuple[str, ...]  # ids_to_pop_from_dataset
    prefetch_batches: int
    # Rows with images (a vision-language model): image slots per row, and what a row whose
    # images do not fit does.
    images_per_row: int
    image_truncation: str
    # A mixture's weights, parsed (config/mixture.py; None: not a mixture), and what it does
    # when a source runs out ("restart" or "stop").
    mixture_stages: Stages | None
    mixture_exhausted: str

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.accumulation_steps

    @classmethod
    def from_arguments(cls, args: Any) -> DataSettings:
        """The one place the pipeline's fields are read from TrainingArguments; a
        DataSettings is returned as it is."""
        if isinstance(args, DataSettings):
            return args
        return cls(
            seq_len=args.max_sequence_length,
            global_batch_size=args.total_batch_size,
            accumulation_steps=args.gradient_accumulation_steps,
            eval_batch_size=args.resolved_eval_batch_size,
            seed=args.seed,
            shuffle=args.shuffle_train,
            drop_last=args.drop_last,
            truncation_mode=args.truncation_mode,
            packing=args.packing,
            packing_window=args.packing_window,
            split_long_documents=args.split_long_documents,
            streaming=args.streaming,
            stream_window=args.stream_window,
            fixed_length=args.max_steps > 0,
            epoch_evaluation=args.evaluation_strategy == "epoch",
            text_column=args.text_column,
            messages_column=args.messages_column,
            completion_only_loss=args.completion_only_loss,
            chat_template=args.chat_template,
            drop_columns=tuple(args.ids_to_pop_from_dataset or ()),
            prefetch_batches=args.prefetch_batches,
            images_per_row=args.images_per_row,
            image_truncation=args.image_truncation,
            mixture_stages=parse_mixture_weights(args.mixture_weights),
            mixture_exhausted=args.mixture_exhausted,
        )


@dataclasses.dataclass(frozen=True)
class MonitorSettings:
    """What the monitor reads of a run's arguments, and nothing else."""

    output_dir: str
    report_to: tuple[str, ...]
    project_name: str
    run_name: str | None
    run_report: bool
    track_memory: bool
    weight_distribution_log_steps: int | None
    max_sequence_length: int  # FLOPs per token are reported at this length
    # Every argument of the run, as trackers record it (W&B config, MLflow params).
    config: dict[str, Any]

    @classmethod
    def from_arguments(cls, args: Any) -> MonitorSettings:
        """The one place these fields are read from TrainingArguments (returned as it is
        when it already is one)."""
        if isinstance(args, MonitorSettings):
            return args
        names = [f.name for f in dataclasses.fields(cls) if f.name not in ("config", "report_to")]
        return cls(
            **{name: getattr(args, name) for name in names},
            report_to=tuple(args.report_to),
            config=args.to_dict(),
        )


@dataclasses.dataclass(frozen=True)
class CheckpointSettings(SameNamedFields):
    """What a run's checkpoints read of its arguments, and nothing else."""

    output_dir: str
    resume_from: str | None
    resume_if_possible: bool
    overwrite_output_dir: bool
    optimizer: str  # a resume refuses a checkpoint of another optimizer
    reset_optimizer: bool
    save_total_limit: int | None  # keep-N


@dataclasses.dataclass(frozen=True)
class LoopSettings(SameNamedFields):
    """What the training loop reads: cadences, stops, saving, the run's files."""

    output_dir: str
    max_steps: int
    num_train_epochs: int
    total_batch_size: int
    max_sequence_length: int
    logging_steps: int
    evaluation_strategy: str
    eval_steps: int
    max_eval_batches: int | None
    save_steps: int | None
    save_final: bool
    save_interval_minutes: float | None
    training_time_limit: str | None
    on_nan: str
    max_nan_skips: int
    progress_bar: str
    profile_steps: list[int] | None  # [first, last] traced with jax.profiler (profiling.py)
    eval_tasks: list[str] | None  # lm-eval tasks run at each evaluation (evaluation/harness.py)
    eval_tasks_limit: int | None

    def total_steps(self, steps_per_epoch: int) -> int:
        """Number of optimizer updates of the run."""
        return self.max_steps if self.max_steps > 0 else steps_per_epoch * self.num_train_epochs


@dataclasses.dataclass(frozen=True)
class RuntimeSettings(SameNamedFields):
    """Where a run computes (runtime/): the cluster it joins, its mesh and sharding rules, the
    XLA options of its compiles and the compilation cache. A run handed a Runtime must agree
    with it on each."""

    distributed: str
    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    distributed_timeout_s: float
    peer_timeout_s: float
    step_timeout_s: float | None
    compilation_cache_dir: str | None
    sharding_axis_dims: tuple[int, ...]
    sharding_rules: dict | None
    sharding_regex_rules: list | None
    xla_compiler_options: dict | None


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """Every section of one run, built once from its arguments (the Trainer, `jaxtrain plan`
    and the run-directory commands do) and handed down: below them, nothing reads the flat
    arguments."""

    model: ModelSettings
    data: DataSettings
    optimizer: OptimizerSettings
    pruning: PruningSettings
    loop: LoopSettings
    monitor: MonitorSettings
    checkpoint: CheckpointSettings
    task: Any  # the task's own fields (task_settings); None for a plain TrainingArguments run

    @classmethod
    def from_arguments(cls, args: Any) -> RunSettings:
        if isinstance(args, cls):
            return args
        return cls(
            model=ModelSettings.from_arguments(args),
            data=DataSettings.from_arguments(args),
            optimizer=OptimizerSettings.from_arguments(args),
            pruning=PruningSettings.from_arguments(args),
            loop=LoopSettings.from_arguments(args),
            monitor=MonitorSettings.from_arguments(args),
            checkpoint=CheckpointSettings.from_arguments(args),
            task=task_settings(args),
        )


def task_settings(args: Any) -> Any:
    """The fields a task's arguments class adds to TrainingArguments (DPO's beta and
    loss_type, GRPO's num_generations...), as a frozen section of their own named after the
    class (DPOSettings, whose `arguments_class` is DPOArguments): the class stays the one
    place they are declared. None when the class adds none."""
    section = _task_section(type(args))
    if section is None:
        return None
    return section(**{f.name: getattr(args, f.name) for f in dataclasses.fields(section)})


@functools.cache
def _task_section(arguments_class: type) -> type | None:
    # TrainingArguments is the root dataclass of every arguments class.
    root = [c for c in arguments_class.__mro__ if dataclasses.is_dataclass(c)][-1]
    base = {f.name for f in dataclasses.fields(root)}
    own = [(f.name, f.type) for f in dataclasses.fields(arguments_class) if f.name not in base]
    if not own:
        return None
    name = arguments_class.__name__.removesuffix("Arguments") + "Settings"

    def reduce(section: Any) -> tuple:  # pickled by its arguments class (rollout processes)
        values = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
        return _rebuild_task_section, (arguments_class, values)

    namespace = {"__reduce__": reduce, "arguments_class": arguments_class}
    # A class's constants stand in for fields it does not have (RLOO has no sampler
    # correction: `sampler_correction: ClassVar[str] = "none"`); the section keeps them.
    for klass in arguments_class.__mro__[: arguments_class.__mro__.index(root)]:
        for field_name, annotation in vars(klass).get("__annotations__", {}).items():
            if str(annotation).startswith(("ClassVar", "typing.ClassVar")):
                namespace.setdefault(field_name, getattr(arguments_class, field_name))
    return dataclasses.make_dataclass(name, own, frozen=True, namespace=namespace)


def _rebuild_task_section(arguments_class: type, values: dict[str, Any]) -> Any:
    return _task_section(arguments_class)(**values)
