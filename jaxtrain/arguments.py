"""TrainingArguments: every knob of a run, validated on construction.

Each field is read somewhere in the code; the docstring of a field says what it does.
Arguments round-trip through YAML/JSON and accept `--field value` overrides from the CLI.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import typing
from pathlib import Path
from typing import Any

from jaxtrain.config.checks import normalized_fields, validate_arguments
from jaxtrain.config.tables import (  # noqa: F401 - the constants' old import path
    DTYPES,
    EVALUATION_STRATEGIES,
    ON_NAN,
    PROGRESS_BARS,
    REPORT_TO,
)
from jaxtrain.config_values import coerce_value, read_config_file  # noqa: F401 - old path
from jaxtrain.errors import ArgumentError
from jaxtrain.seed_names import seed_name_hint


class UnknownFieldError(ArgumentError):
    """Field names an arguments class lacks: the user's own words (the CLI adds no note on
    where the other values came from)."""


def unknown_fields_error(unknown: list[str], known: list[str], source: str) -> ArgumentError:
    """The error for field names TrainingArguments lacks: an EasyDeL name is answered with
    its jaxtrain spelling (jaxtrain.seed_names), any other with the closest field."""
    seeds = [hint for hint in map(seed_name_hint, unknown) if hint]
    others = [key for key in unknown if not seed_name_hint(key)]
    hints = []
    for key in others:
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    lines = [
        f"Unknown TrainingArguments field(s) in {source}: {', '.join(hints)}. "
        "Remove them or fix the spelling."
    ] if hints else []  # fmt: skip
    lines += [f"{hint}; rename or remove it in {source}." for hint in seeds]
    return UnknownFieldError(" ".join(lines))


# A smoke test of a whole script: JAXTRAIN_MAX_STEPS=N caps every run of the process at N
# updates and every evaluation at N batches (tests/test_docs.py runs the README and docs/ this way).
STEP_CAP_VARIABLE = "JAXTRAIN_MAX_STEPS"
logger = logging.getLogger("jaxtrain")


def apply_step_cap(args: Any) -> None:
    """Shorten `args` in place to $JAXTRAIN_MAX_STEPS updates, when it is set."""
    raw = os.environ.get(STEP_CAP_VARIABLE, "").strip()
    if not raw:
        return
    if not raw.isdigit() or int(raw) < 1:
        raise ArgumentError(f"{STEP_CAP_VARIABLE}={raw!r} must be a positive number of steps.")
    cap = int(raw)
    before = args.max_steps
    args.max_steps = cap if args.max_steps <= 0 else min(args.max_steps, cap)
    args.max_eval_batches = min(args.max_eval_batches or cap, cap)
    args.warmup_steps = min(args.warmup_steps, args.max_steps // 2)  # the schedule must fit
    if before > args.max_steps and args.pruning_end_step is not None:
        # The pruning window shrinks with the run, so its checks still hold.
        args.pruning_begin_step = args.pruning_begin_step * args.max_steps // before
        args.pruning_end_step = max(
            args.pruning_begin_step + 1, args.pruning_end_step * args.max_steps // before
        )
        args.pruning_frequency = max(1, args.pruning_frequency * args.max_steps // before)
    if args.max_steps != before:
        logger.warning(
            "jaxtrain: %s=%d: max_steps %d -> %d, max_eval_batches <= %d.",
            STEP_CAP_VARIABLE, cap, before, args.max_steps, cap,
        )  # fmt: skip


@dataclasses.dataclass
class TrainingArguments:
    # Where everything of the run goes: arguments.json, metrics.jsonl, checkpoints/.
    output_dir: str = "runs/jaxtrain"
    # Refuse to write into an output_dir that already holds checkpoints unless True
    # (then the old checkpoints are deleted first).
    overwrite_output_dir: bool = False
    seed: int = 0

    # Optimisation.
    learning_rate: float = 3e-4
    optimizer: str = "adamw"
    scheduler: str = "cosine"
    warmup_steps: int = 0
    # Final learning rate of decaying schedules, as a fraction of learning_rate.
    min_lr_ratio: float = 0.0
    # wsd: fraction of the run spent in the final linear decay.
    wsd_decay_fraction: float = 0.1
    # Decoupled weight decay; never applied to norms and biases (params with ndim < 2).
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    # Momentum of sgd.
    momentum: float = 0.9
    # The dtype AdamW's first moment (Lion's, SGD's, Muon's momentum) is stored in, e.g.
    # "bfloat16": a quarter less optimizer state for AdamW, half for the others. None: the
    # parameters' dtype. The second moment stays in the parameters' dtype.
    mu_dtype: str | None = None
    # Global-norm gradient clipping; None or 0 disables it.
    clip_grad: float | None = 1.0

    # Length of the run: max_steps > 0 wins over num_train_epochs.
    num_train_epochs: int = 1
    max_steps: int = -1

    # Global sequences per optimizer update, across devices and micro-batches.
    total_batch_size: int = 32
    # Micro-batches per update; each holds total_batch_size / gradient_accumulation_steps rows.
    gradient_accumulation_steps: int = 1
    # Rows per eval batch; None means the training micro-batch size.
    eval_batch_size: int | None = None
    max_sequence_length: int = 512
    # Which end of an over-long sequence survives truncation.
    truncation_mode: str = "keep_end"
    # Column holding raw text, tokenized with processing_class when input_ids is absent.
    text_column: str = "text"
    shuffle_train: bool = True
    # Batches prepared ahead by a background thread.
    prefetch_batches: int = 2
    # --- data pipeline (jaxtrain/data; validated in _validate_data) ---
    # Pack several documents per row (segment_ids + per-document positions); needs max_steps.
    packing: bool = False
    # Packing places the documents of blocks of this many documents (best-fit decreasing).
    packing_window: int = 1024
    # Packing splits a document longer than a row into row-sized pieces (each its own
    # document); False truncates it by truncation_mode (counted in data/truncated_tokens).
    split_long_documents: bool = True
    # True: an epoch is rows // total_batch_size steps, the shuffled rest waits for another
    # epoch. False: the last batch is completed with masked filler rows, every row is seen.
    drop_last: bool = True
    # Columns removed from every row before featurizing (and before a data_collator).
    ids_to_pop_from_dataset: list[str] | None = None
    # Column of chat rows: a list of {"role", "content"} rendered with the chat template.
    messages_column: str = "messages"
    # Chat rows: learn only the assistant replies (prompt labels -100).
    completion_only_loss: bool = False
    # A Jinja chat template replacing the tokenizer's own.
    chat_template: str | None = None
    # Rows with images (a vision-language model's, data/vision.py): the image slots of each
    # batch row; a row with more images is an error.
    images_per_row: int = 1
    # A row whose truncation would cut an image's tokens: "error", or "drop" (skipped, counted).
    image_truncation: str = "error"
    # Read dataset_train as a stream (files, datasets.Dataset); needs max_steps.
    streaming: bool = False
    # Streams are shuffled within blocks of this many rows (1 = stream order).
    stream_window: int = 1024
    # A mixture (dataset_train a mapping {name: source}; docs/data.md "Mixtures"): the share
    # of each step's rows per source, {name: weight}, or stages [[step, {name: weight}], ...]
    # from step 0 on (annealing; a source a stage leaves out has weight 0 there). Weights are
    # >= 0 and need not sum to 1. Needs max_steps.
    mixture_weights: dict | list | None = None
    # A mixture source that runs out of rows: "restart" (its next epoch, counted per source)
    # or "stop" (the run ends after the last step whose rows it could give).
    mixture_exhausted: str = "restart"

    # Mixed precision: compute in dtype, keep master parameters (and frozen weights: a
    # reference, a LoRA base) in param_dtype.
    # None keeps what the model was built with.
    dtype: str | None = None
    param_dtype: str | None = None
    # Rematerialisation policy of each decoder layer.
    gradient_checkpointing: str = "none"
    # A vision-language model's vision tower keeps its weights (its projector and decoder
    # train). Under LoRA the whole image encoder keeps them: adapters go on the decoder.
    freeze_vision_tower: bool = False
    # Run the decoder layers under one jax.lax.scan (models/layer_scan.py): a layer is traced
    # and compiled once, not once per layer, so compile time stops growing with depth; the
    # parameters, checkpoints and results are the same (docs/training.md "Layers under scan").
    # None: on for a quantized base (QLoRA: each layer's kernels dequantized in its own scan
    # step, so no float copy of the whole base exists), else off.
    scan_layers: bool | None = None
    # The decoder layers' projections with both operands in float8 (models/fp8.py: e4m3
    # forward, e5m2 gradients, per-tensor current scaling) for the FP8 tensor cores of
    # Hopper-class GPUs; the embedding, norms and LM head stay in `dtype`.
    fp8_matmuls: bool = False
    # The decoder layers' elementwise work (models/elementwise.py: the residual add with the
    # MLP's RMSNorm, SwiGLU's gate, rotary embeddings): "xla" (XLA fuses it), "pallas" (one
    # fused Triton kernel each, NVIDIA GPUs) or "interpret" (those kernels interpreted: tests).
    elementwise_kernels: str = "xla"

    # LoRA: rank of the adapters (0 = off). Only the adapters are trained, held in the
    # optimizer state and checkpointed; the base weights stay frozen (jaxtrain.models.lora).
    lora_rank: int = 0
    # Adapter scale alpha / rank.
    lora_alpha: float = 16.0
    # Dropout on the adapters' input during training.
    lora_dropout: float = 0.0
    # What gets adapters (PEFT's target_modules): "attention", "mlp", projection names
    # (o_proj, c_attn, mlp.c_proj, fc1) or parts of fused kernels (q_proj, v_proj, up_proj).
    # None: the groups attention and mlp the model has (a mixture-of-experts model's experts
    # take no adapter: attention, plus a shared expert's or dense layers' MLP).
    lora_targets: list[str] | None = None

    # QLoRA: the frozen base stored quantized ("nf4": 4-bit NormalFloat with a float32 scale
    # per block of quantization_block_size input rows; "int8": one scale per output channel),
    # dequantized inside the step; needs lora_rank > 0 (only the adapters train).
    quantization: str | None = None
    # NF4: how many input rows share one scale (an even number dividing each kernel's rows).
    quantization_block_size: int = 64
    # The block scales themselves stored as int8 with a scale per 256 (QLoRA's double
    # quantization): 0.52 instead of 0.56 bytes per weight.
    quantization_double: bool = False

    # Gradual magnitude pruning (jaxtrain/training/pruning.py): the fraction of each targeted
    # matrix pruned by pruning_end_step (0 = off), on Zhu and Gupta's cubic schedule from
    # pruning_begin_step, masks updated every pruning_frequency steps.
    pruning_target_sparsity: float = 0.0
    # The step pruning starts at (the sparsity is 0 before it).
    pruning_begin_step: int = 0
    # The step the target sparsity is reached at; None: the run's last step.
    pruning_end_step: int | None = None
    # Steps between two updates of the masks.
    pruning_frequency: int = 100
    # Regexes searched in parameter paths ('model/layers/0/mlp/down_proj/kernel'); None =
    # every parameter with ndim >= 2 except embeddings and norms.
    pruning_targets: list[str] | None = None

    # Cadences (in optimizer steps).
    logging_steps: int = 10
    evaluation_strategy: str = "steps"
    eval_steps: int = 100
    # Cap on eval batches per evaluation (None = the whole eval set).
    max_eval_batches: int | None = None
    # lm-eval-harness tasks scored at every evaluation (docs/evaluation.md): paths of task
    # YAML files, or names of jaxtrain's example tasks; their data must be local files.
    eval_tasks: list[str] | None = None
    # Documents scored per task and evaluation (None = all of them).
    eval_tasks_limit: int | None = None
    # Periodic checkpoint every save_steps (None = only the final save).
    save_steps: int | None = None
    # Keep at most this many checkpoints (None = keep all).
    save_total_limit: int | None = None
    # Write a checkpoint when training ends.
    save_final: bool = True
    # Also checkpoint when this many minutes passed since the last save (None = off).
    save_interval_minutes: float | None = None
    # Continue from the newest committed checkpoint in output_dir when there is one.
    resume_if_possible: bool = True
    # Resume from this checkpoint (a step directory, or a run directory: its newest one).
    resume_from: str | None = None
    # On resume, restore parameters, step and data position but start a fresh optimizer
    # state (e.g. after changing the optimizer).
    reset_optimizer: bool = False
    # Save and stop cleanly after this much wall time: "2h30m", "1d", "90m", "HH:MM:SS".
    training_time_limit: str | None = None
    # A NaN/Inf loss or gradient: "stop" (error, nothing bad is applied or saved) or "skip"
    # (drop that update and go on, up to max_nan_skips consecutive times).
    on_nan: str = "stop"
    max_nan_skips: int = 10
    progress_bar: str = "rich"

    # Observability (see docs/observability.md). Trackers besides metrics.jsonl (always
    # written): any of "tensorboard", "wandb", "mlflow"; on the CLI a comma-separated list.
    report_to: list[str] = dataclasses.field(default_factory=lambda: ["jsonl"])
    # W&B project / MLflow experiment, and the run's name (default: run-<date>-<time>).
    project_name: str = "jaxtrain"
    run_name: str | None = None
    # Log device memory (memory_stats) and host RSS at logging cadence.
    track_memory: bool = False
    # Weight mean/std/min/max/norm per parameter group (and TensorBoard histograms) every
    # this many steps; None = off.
    weight_distribution_log_steps: int | None = None
    # Write report.png and report.html into output_dir when training ends.
    run_report: bool = True
    # JAX's persistent compilation cache: "auto" = $JAXTRAIN_CACHE/xla (default
    # ~/.cache/jaxtrain/xla), a directory, or None (off). Reruns, resumes and sweep trials
    # load their compiled steps from it. A JAX_COMPILATION_CACHE_DIR you set wins.
    compilation_cache_dir: str | None = "auto"
    # XLA options of every step compile (names of XLA's DebugOptions): None = jaxtrain's
    # defaults (on CPU, xla_backend_optimization_level=1: faster compiles, same step time;
    # jaxtrain/runtime/compiler.py); {} = XLA's own. CLI: '{xla_cpu_enable_fast_math: true}'.
    xla_compiler_options: dict | None = None
    # Parallelism (docs/parallelism.md). Mesh sizes
    # (dp, fsdp, ep, tp, sp); one entry may be -1 (the remaining devices). CLI: 1,-1,1,1,1.
    sharding_axis_dims: tuple[int, ...] = (1, -1, 1, 1, 1)
    # Logical axis name -> mesh axis, list of axes or None; overrides the default table.
    sharding_rules: dict | None = None
    # [[regex on the parameter path, [mesh axis | list | None per dim]], ...]; first match wins.
    sharding_regex_rules: list | None = None
    # Multi-host: "auto" (when arguments or environment describe a cluster), "on", "off".
    distributed: str = "auto"
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # Give up (DistributedError, exit code 2) when the cluster is not formed within this time.
    distributed_timeout_s: float = 300.0
    # Multi-host: a process whose heartbeat stops this long (dead or hung) is lost; every
    # other process then prints one line and exits with code 5 (parallel/peers.py). JAX's
    # own heartbeat timeout becomes 2 * this + 10 s.
    peer_timeout_s: float = 30.0
    # A jax.profiler trace of these steps, [first, last] (CLI --profile_steps 10-12), per
    # process under output_dir/profile/process_<i>: xprof / TensorBoard and Perfetto files
    # (observability/profiling.py). None: no trace.
    profile_steps: str | list[int] | None = None
    # Multi-host progress watch: a process that is alive but whose training loop has not
    # moved past a step for this long (a collective that never returns on one rank, a data
    # loader deadlocked on one host) is stuck; every process prints one line naming it and
    # its last step and exits with code 5. Evaluations and saves do not count. None: off.
    step_timeout_s: float | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> TrainingArguments:
        # Unknown keyword arguments get the same answer as unknown config keys (an EasyDeL
        # name gets its jaxtrain spelling) instead of the dataclass __init__'s TypeError.
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise unknown_fields_error(unknown, known, "keyword arguments")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # Parsed once, here: CLI strings become lists and tuples, names are lowered. The
        # checks after this only read.
        for name, value in normalized_fields(self).items():
            setattr(self, name, value)
        apply_step_cap(self)
        validate_arguments(self)

    # ----- derived values -----
    @property
    def micro_batch_size(self) -> int:
        return self.total_batch_size // self.gradient_accumulation_steps

    @property
    def resolved_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.micro_batch_size

    def total_steps(self, steps_per_epoch: int) -> int:
        """Number of optimizer updates of the run."""
        if self.max_steps > 0:
            return self.max_steps
        return steps_per_epoch * self.num_train_epochs

    # ----- serialisation -----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_dict(
        cls,
        values: dict[str, Any],
        *,
        source: str = "arguments",
        sources: dict[str, str] | None = None,
    ) -> TrainingArguments:
        """Fields from a mapping, each parsed by its declared type; an error names where the
        value came from: `sources[field]` (a config file, the command line) else `source`."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [k for k in values if k not in known]
        if unknown:  # named where they were written (the command line, a file) when known
            where = sorted({(sources or {}).get(k, source) for k in unknown})
            where = ["the command line" if w == "command line" else w for w in where]
            raise unknown_fields_error(unknown, list(known), " and ".join(where))
        hints_by_name = typing.get_type_hints(cls)
        coerced = {
            k: coerce_value(hints_by_name[k], v, field=k, source=(sources or {}).get(k, source))
            for k, v in values.items()
        }
        return cls(**coerced)

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> TrainingArguments:
        """Read YAML or JSON; overrides win over the file."""
        values = read_config_file(path)
        values.update(overrides)
        return cls.from_dict(values, source=str(path))


def task_fields(arguments_class: type[TrainingArguments]) -> list[str]:
    """The fields an arguments class adds to TrainingArguments (DPOArguments' beta,
    loss_type...), in the order it declares them; none for TrainingArguments itself."""
    base = {field.name for field in dataclasses.fields(TrainingArguments)}
    return [field.name for field in dataclasses.fields(arguments_class) if field.name not in base]
