"""The Trainer: wires arguments, model, data, optimizer and checkpoints, and runs the loop.

The loop only orchestrates. The math lives in `step.py` (pure, jitted); data in
`jaxtrain.data`; files in `checkpoint.py` and `logs.py`. The device never waits for the host:
step n+1 is dispatched before the metrics of step n are read, and metrics are read only at
logging cadence.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.arguments import ArgumentError, TrainingArguments
from jaxtrain.data import BatchLoader, eval_batches, prefetch, validate_dataset
from jaxtrain.training import checkpoint as ckpt
from jaxtrain.training.hooks import TrainerCallback, call_hooks
from jaxtrain.training.logs import JsonlLog
from jaxtrain.training.metrics import MetricsWindow, eval_summary, host_token_count
from jaxtrain.training.optim import build_optimizer, build_schedule
from jaxtrain.training.progress import make_progress
from jaxtrain.training.state import TrainState, count_parameters
from jaxtrain.training.step import (
    causal_lm_loss_sums,
    count_target_tokens,
    make_eval_step,
    make_train_step,
)


@dataclasses.dataclass
class TrainerOutput:
    """What `Trainer.train()` returns."""

    state: TrainState
    # Last logged training metrics and the final evaluation ("eval/..." keys).
    metrics: dict[str, float]
    # Step directory of the last checkpoint written, if any.
    checkpoint_path: str | None
    mesh: jax.sharding.Mesh | None = None


class Trainer(TrainerCallback):
    """Train a Flax NNX causal LM (or any module returning logits) on a dataset.

    Subclasses may override `compute_loss_sums` / `loss_normalizer` for another objective and
    any hook of TrainerCallback.
    """

    def __init__(
        self,
        arguments: TrainingArguments | None = None,
        model: nnx.Module | None = None,
        dataset_train: Any = None,
        dataset_eval: Any = None,
        data_collator: Callable[[list[dict]], dict[str, np.ndarray]] | None = None,
        processing_class: Any = None,
        callbacks: list[Any] | None = None,
    ):
        if model is None:
            raise ArgumentError("Trainer needs a model: Trainer(arguments=..., model=...).")
        self.arguments = args = arguments if arguments is not None else TrainingArguments()
        self.processing_class = processing_class
        self.data_collator = data_collator
        self.callbacks = list(callbacks or [])
        self.should_stop = False
        self.model = model
        self.model_config = getattr(model, "config", None)
        self._configure_model(model)
        self.pad_token_id = self._resolve_pad_token_id()

        # Datasets are checked now, before anything is compiled.
        self.dataset_train = dataset_train
        self.dataset_eval = dataset_eval
        self.train_loader = None
        if dataset_train is not None:
            validate_dataset(
                dataset_train,
                name="dataset_train",
                tokenizer=processing_class,
                text_column=args.text_column,
                min_rows=args.total_batch_size,
            )
            self.train_loader = BatchLoader(
                dataset_train,
                global_batch_size=args.total_batch_size,
                accumulation_steps=args.gradient_accumulation_steps,
                shuffle=args.shuffle_train,
                seed=args.seed,
                **self._collation_options(),
            )
        if dataset_eval is not None:
            validate_dataset(
                dataset_eval,
                name="dataset_eval",
                tokenizer=processing_class,
                text_column=args.text_column,
            )
        # Without training data (eval or sampling only) the schedule's length is moot: it
        # does not change the optimizer state's structure.
        steps = self.total_steps if self.train_loader else max(args.max_steps, 1)
        self.optimizer, self.schedule = self.create_optimizer(steps)
        self._train_step = None
        self._eval_step = None
        self._checkpointer = None  # created at the first save of a run

    # ------------------------------------------------------------------ setup
    def _collation_options(self) -> dict[str, Any]:
        """How rows become batches; shared by the train and eval pipelines."""
        args = self.arguments
        return {
            "seq_len": args.max_sequence_length,
            "pad_token_id": self.pad_token_id,
            "truncation_mode": args.truncation_mode,
            "tokenizer": self.processing_class,
            "text_column": args.text_column,
            "collator": self.data_collator,
        }

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
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        if args.param_dtype is not None:
            param_dtype = jnp.dtype(args.param_dtype)
            params = jax.tree.map(
                lambda x: x.astype(param_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                params,
            )
        self._initial_params = params
        self.num_parameters = count_parameters(params)

    def _resolve_pad_token_id(self) -> int:
        for source in (self.processing_class, self.model_config):
            pad = getattr(source, "pad_token_id", None)
            if pad is not None:
                return int(pad)
        return 0

    def compute_loss_sums(self, model: nnx.Module, batch: dict[str, jax.Array], rng: jax.Array):
        """Sums over one micro-batch; must return at least "loss_sum" and "tokens"."""
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

    def create_state(self) -> TrainState:
        """A fresh state; parameters are copied so the user's model survives donation."""
        params = jax.tree.map(jnp.copy, self._initial_params)
        return TrainState.create(params, self.optimizer)

    def model_from_state(self, state: TrainState) -> nnx.Module:
        """A model object carrying `state`'s parameters (for sampling, export, ...)."""
        return nnx.merge(self.graphdef, state.params, self.rest)

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self, state: TrainState) -> str:
        if self._checkpointer is None:
            self._checkpointer = ckpt.Checkpointer(
                self.arguments.output_dir, max_to_keep=self.arguments.save_total_limit
            )
        path = self._checkpointer.save(state, metadata=self._checkpoint_metadata(state))
        step = int(jax.device_get(state.step))
        call_hooks(self._receivers, "on_save", self, str(path), step)
        return str(path)

    def _checkpoint_metadata(self, state: TrainState) -> dict[str, Any]:
        config = self.model_config
        return {
            "step": int(jax.device_get(state.step)),
            "arguments": self.arguments.to_dict(),
            "model_config": config.to_dict() if hasattr(config, "to_dict") else None,
            "model_class": type(self.model).__name__,
        }

    def load_checkpoint(self, path: str | Path) -> TrainState:
        """Restore a TrainState written by this kind of Trainer (same model and optimizer)."""
        abstract = jax.eval_shape(self.create_state)
        return ckpt.restore_state(path, abstract)

    # ------------------------------------------------------------------ train
    @property
    def _receivers(self) -> list[Any]:
        return [self, *self.callbacks]

    def train(self) -> TrainerOutput:
        args = self.arguments
        total_steps = self.total_steps
        ckpt.prepare_output_dir(args.output_dir, overwrite=args.overwrite_output_dir)
        out_dir = Path(args.output_dir)
        args.save(out_dir / "arguments.json")
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(out_dir / "tokenizer")

        state = self.create_state()
        log = JsonlLog(out_dir / "metrics.jsonl")
        batches = prefetch(self.train_loader.batches(start_step=0), size=args.prefetch_batches)
        progress = make_progress(args.progress_bar, total_steps)
        progress.write(
            f"jaxtrain: {self.num_parameters / 1e6:.2f}M parameters, {total_steps} steps, "
            f"{args.total_batch_size} x {args.max_sequence_length} tokens per step, "
            f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}"
        )
        call_hooks(self._receivers, "on_train_start", self, state)

        last_logs: dict[str, float] = {}
        eval_metrics: dict[str, float] = {}
        last_eval_step = saved_step = -1
        checkpoint_path = None
        window = MetricsWindow()
        pending = None  # a closed logging window whose device metrics are read one step late
        step = 0
        try:
            while step < total_steps and not self.should_stop:
                batch = next(batches)
                if self._train_step is None:
                    self._train_step = self._compile_train_step(state, batch, log, progress)
                call_hooks(self._receivers, "on_step_start", self, state, step)
                state, metrics = self._train_step(state, batch)
                step += 1
                window.add(metrics, host_token_count(batch))
                if pending is not None:
                    last_logs = self._emit_logs(pending, log, progress)
                    pending = None
                call_hooks(self._receivers, "on_step_end", self, state, metrics, step)
                if step % args.logging_steps == 0 or step == total_steps or self.should_stop:
                    epoch = step / self.train_loader.steps_per_epoch
                    pending = window.close(step, epoch=epoch)
                progress.update(step)

                if self._eval_due(step, total_steps) or self._save_due(step):
                    if pending is not None:
                        last_logs = self._emit_logs(pending, log, progress)
                        pending = None
                    if self._eval_due(step, total_steps):
                        eval_metrics = self._run_evaluation(state, step, log, progress)
                        last_eval_step = step
                    if self._save_due(step):
                        checkpoint_path = self.save_checkpoint(state)
                        saved_step = step
                    window.restart_clock()
            if pending is not None:
                last_logs = self._emit_logs(pending, log, progress)
            if self._wants_eval() and last_eval_step != step:  # stopped early by a hook
                eval_metrics = self._run_evaluation(state, step, log, progress)
            if args.save_final and saved_step != step:
                checkpoint_path = self.save_checkpoint(state)
        finally:
            if self._checkpointer is not None:
                self._checkpointer.close()  # waits for the background writes to commit
                self._checkpointer = None
            progress.close()
            log.close()

        nnx.update(self.model, state.params)
        output = TrainerOutput(
            state=state, metrics={**last_logs, **eval_metrics}, checkpoint_path=checkpoint_path
        )
        call_hooks(self._receivers, "on_train_end", self, output)
        return output

    def _compile_train_step(self, state, batch, log: JsonlLog, progress):
        step_fn = make_train_step(
            graphdef=self.graphdef,
            rest=self.rest,
            optimizer=self.optimizer,
            schedule=self.schedule,
            seed=self.arguments.seed,
            loss_sums_fn=self.compute_loss_sums,
            normalizer_fn=self.loss_normalizer,
        )
        start = time.perf_counter()
        # Compiled ahead of time: a batch of another shape is an error, never a silent recompile.
        compiled = jax.jit(step_fn, donate_argnums=0).lower(state, batch).compile()
        seconds = time.perf_counter() - start
        log.write(0, {"compile/train_step_s": seconds})
        progress.write(f"compiled train step in {seconds:.1f}s")
        return compiled

    def _emit_logs(self, window_stats, log: JsonlLog, progress) -> dict[str, float]:
        logs = window_stats.read()
        log.write(logs["step"], logs)
        call_hooks(self._receivers, "on_log", self, logs, logs["step"])
        shown = {k: logs[k] for k in ("loss", "learning_rate", "tokens_per_second") if k in logs}
        progress.update(logs["step"], shown)
        return logs

    def _wants_eval(self) -> bool:
        return self.dataset_eval is not None and self.arguments.evaluation_strategy != "no"

    def _eval_due(self, step: int, total_steps: int) -> bool:
        if not self._wants_eval():
            return False
        args = self.arguments
        if step == total_steps:
            return True
        if args.evaluation_strategy == "steps":
            return step % args.eval_steps == 0
        return step % self.train_loader.steps_per_epoch == 0  # "epoch"

    def _save_due(self, step: int) -> bool:
        save_steps = self.arguments.save_steps
        return save_steps is not None and step % save_steps == 0

    def _run_evaluation(self, state, step: int, log: JsonlLog, progress) -> dict[str, float]:
        metrics = self.evaluate(state)
        log.write(step, metrics)
        call_hooks(self._receivers, "on_evaluate", self, metrics, step)
        progress.write(
            f"step {step}: eval loss {metrics['eval/loss']:.4f}, "
            f"ppl {metrics['eval/perplexity']:.2f}, acc {metrics['eval/accuracy']:.3f}"
        )
        return metrics

    # ------------------------------------------------------------------- eval
    def eval(self, state: TrainState) -> Iterator[dict[str, float]]:
        """Evaluate on dataset_eval; yields running token-weighted metrics after each batch.

        The last yielded dict covers the whole eval set (or max_eval_batches batches).
        """
        if self.dataset_eval is None:
            raise ArgumentError("Trainer.eval() needs dataset_eval.")
        args = self.arguments
        batches = eval_batches(
            self.dataset_eval,
            batch_size=args.resolved_eval_batch_size,
            **self._collation_options(),
        )
        totals: dict[str, float] = {}
        previous = None
        count = 0
        for index, batch in enumerate(batches):
            if args.max_eval_batches is not None and index >= args.max_eval_batches:
                break
            if self._eval_step is None:
                fn = make_eval_step(
                    graphdef=self.graphdef, rest=self.rest, loss_sums_fn=self.compute_loss_sums
                )
                self._eval_step = jax.jit(fn).lower(state.params, batch).compile()
            sums = self._eval_step(state.params, batch)
            # Read the previous batch's sums only after this one is dispatched.
            if previous is not None:
                count += 1
                yield eval_summary(totals, jax.device_get(previous), count)
            previous = sums
        if previous is not None:
            count += 1
            yield eval_summary(totals, jax.device_get(previous), count)

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """Metrics over the whole eval set (the last value `eval` yields)."""
        metrics: dict[str, float] = {}
        for metrics in self.eval(state):  # noqa: B007 - the last yield covers the whole set
            pass
        return metrics


def param_logical_axes(params: Any) -> Any:
    """The `logical_axes` metadata of each nnx.Param (None where a param has none)."""
    return jax.tree.map(
        lambda v: v.get_metadata().get("logical_axes") if isinstance(v, nnx.Variable) else None,
        params,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
