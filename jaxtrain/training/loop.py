"""One call of `Trainer.train()`: the loop that orchestrates steps, logs, evals and saves.

The loop only orchestrates: the math is in `step.py` (pure, jitted), data in
`jaxtrain.data`, checkpoints in `jaxtrain.checkpointing`, measurements in
`jaxtrain.observability`. It talks to the Trainer through its public interface only (see
trainer.py) and owns what it creates: the compiled step, the progress bar, the log, the
batch reader. Evaluation and saving are hooks with cadences of their own (run_hooks.py).
The device never waits for the host: step n+1 is dispatched before the metrics of step n
are read, and metrics are read only at logging cadence (one step late).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax

from jaxtrain.checkpointing import RunStart, StartPlan, committed_steps, hold_output_dir
from jaxtrain.data.batch_source import DataExhausted
from jaxtrain.errors import ArgumentError, DatasetError
from jaxtrain.observability.compiles import memory_summary
from jaxtrain.observability.profiling import StepProfiler, profile_line
from jaxtrain.observability.progress import make_progress
from jaxtrain.parallel.peers import note_checkpoints, note_progress
from jaxtrain.state import TrainState
from jaxtrain.training.hooks import HookSet
from jaxtrain.training.out_of_memory import is_out_of_memory, out_of_memory_error
from jaxtrain.training.run_hooks import EvaluationHook, SaveHook, StopState
from jaxtrain.training.run_parts import RunParts
from jaxtrain.training.startup import startup_summary, summary_lines
from jaxtrain.training.stopping import (
    Deadline,
    NonFiniteGuard,
    StopSignals,
    TrainingInterrupted,
    any_process,
    preemption_sync_reached,
    time_limit_seconds,
)

logger = logging.getLogger(__name__)

# Multi-host runs agree on signals, the time limit and interval saves this often (steps).
MULTI_HOST_POLL_STEPS = 10


def counts_rows(state: Any) -> bool:
    """Whether a train source's data state holds its row count (map-style data), which a
    resume compares: a stream's position holds none, and a row dropped there resumes."""
    if isinstance(state, dict):
        return state.get("num_rows") is not None or any(counts_rows(v) for v in state.values())
    return isinstance(state, list) and any(counts_rows(v) for v in state)


def add_resume_note(err: DatasetError, saved: list[int], data_state: Callable[[], Any]) -> None:
    """Tell `err`, whose advice to drop a train row would lose the run's checkpoints (a
    dataset with a row fewer does not fit their data position: the resume is refused), so."""
    text = str(err)
    if "drop that row" not in text or "dataset_eval" in text or not saved:
        return
    if counts_rows(data_state()):
        err.args = (
            f"{text}. This run has checkpoints (the latest at step {saved[-1]}), which resume "
            "only on the same rows: fix that row in place rather than dropping it, then run "
            "the same command again to resume.",
            *err.args[1:],
        )


@dataclasses.dataclass
class TrainerOutput:
    """What `Trainer.train()` returns."""

    state: TrainState
    # Last logged training metrics and the final evaluation ("eval/..." keys).
    metrics: dict[str, float]
    # Step directory of the last checkpoint written, if any.
    checkpoint_path: str | None
    # The device mesh the state lives on.
    mesh: jax.sharding.Mesh | None = None
    # "completed", "callback" (a hook set should_stop), "time_limit" (training_time_limit) or
    # "data_exhausted" (a mixture's source ran out, mixture_exhausted="stop").
    stop_reason: str = "completed"


class TrainingLoop:
    """The state of one training run between its first and last step."""

    def __init__(self, trainer: RunParts):
        self.trainer = trainer
        self.settings = trainer.settings.loop
        self.program, self.source = trainer.program, trainer.train_source
        self.total_steps = self.settings.total_steps(self.source.steps_per_epoch)
        self.deadline = Deadline(time_limit_seconds(self.settings.training_time_limit))
        self.last_logs: dict[str, float] = {}
        self.eval_metrics: dict[str, float] = {}
        self.checkpoint_path: str | None = None
        self.stop_reason = "completed"
        self.guard = NonFiniteGuard(self.settings.on_nan, self.settings.max_nan_skips)
        self.skipped_steps = 0  # updates skipped for a NaN/Inf, through the last logged window
        self.pending = None  # a closed logging window whose device metrics are read one step late
        self.pending_data: dict[str, float] = {}  # and the data meter's counts at its close
        self.hooks = trainer.hooks  # who hears about the run, fixed for its duration
        self.train_step = None  # compiled while the state is built; this run owns it
        self.stop = StopState()  # why the loop leaves after this step, if it does
        self.step_memory = None  # the compiled step's memory_summary, once compiled
        self.read_step = 0  # the last step whose results were read (it ran)

    def run(self) -> TrainerOutput:
        # Held from the plan to the last commit: a second run into this directory is refused.
        with hold_output_dir(self.settings.output_dir, take=self.trainer.runtime.is_main_process):
            try:
                return self._run()
            except DatasetError as err:  # a bad row read mid-run (a stream's, a tokenizer's)
                saved = committed_steps(self.trainer.checkpoints.root)
                step = getattr(self, "step", 0)  # set once the start is planned
                add_resume_note(err, saved, lambda: self.source.data_state(step))
                raise

    def _run(self) -> TrainerOutput:
        trainer, settings, checkpoints = self.trainer, self.settings, self.trainer.checkpoints
        # Named in the line of a lost peer process (multi-host).
        note_checkpoints(checkpoints.root, committed_steps)
        plan = checkpoints.plan_start()  # a resume that cannot happen fails here, before any work
        if plan.step > self.total_steps:  # a finished run's rerun (==) trains nothing, rightly
            raise ArgumentError(
                f"{plan.resumed_from} is at step {plan.step}, past this run's {self.total_steps} "
                "steps (max_steps, or num_train_epochs): raise max_steps to train on from it, or "
                "resume from an earlier checkpoint."
            )
        self.profiler = StepProfiler(
            settings.profile_steps,
            settings.output_dir,
            trainer.runtime.process_index,
            announce=self._profile_written,
        )
        self.profiler.check_steps(plan.step, self.total_steps)
        if trainer.runtime.is_main_process:
            checkpoints.write_run_files()
        # Written by process 0 only; a resumed run continues its trackers' runs.
        self.log = trainer.monitor.open(settings.output_dir, plan.step, plan.tracker_state)
        primary = trainer.runtime.is_main_process
        self.progress = make_progress(
            settings.progress_bar, self.total_steps, plan.step, primary=primary
        )
        self.latest_state = None  # the newest live state, for the model object on a failure
        self.step = plan.step  # steps done: what the progress watch of a multi-host run reads
        self.read_step = plan.step
        try:
            self.source.open(plan.step, self.program)
            start = self._start(plan)
            state = jax.device_put(start.state, self.program.state_shardings)  # no-op if placed
            self.latest_state = state
            if start.resumed_from is not None:
                self.checkpoint_path = str(start.resumed_from)
            self.hooks.call("on_train_start", trainer, state)
            with StopSignals() as signals:
                state, step = self._steps(state, start.step, signals, start)
        except BaseException as err:
            self.program.return_parameters(self.latest_state)
            if is_out_of_memory(err):  # one line with the figures, not XLA's traceback
                raise out_of_memory_error(
                    err,
                    self.read_step,
                    self.step_memory,
                    settings.output_dir,
                    trainer.runtime.process_index,
                ) from err
            raise
        finally:
            note_progress(self.step, "end")  # the final save and report are no steps
            self.profiler.close()  # a window the run left early keeps what it traced
            try:
                checkpoints.close()  # waits for the background writes to commit
            finally:
                self.source.close()  # a train loader is endless: stop its reader
                self.progress.close()
                self.log.close()
        return self._finish(state, step)

    def _start(self, plan: StartPlan) -> RunStart:
        """The run's first state, built (or restored) while XLA compiles its train step for
        the source's batches in a second thread: the step is traced from the state's and the
        batch's shapes and shardings, so neither waits for the other. A fresh state's own
        compile runs beside the step's trace."""
        checkpoints, program = self.trainer.checkpoints, self.program
        if plan.step >= self.total_steps:  # a finished run: nothing to compile
            start = checkpoints.start_state(plan)
            self._announce(start)
            return start
        try:
            batch = self.source.abstract_batch()
        except DataExhausted:  # a finite source that already ended: nothing to train
            self.total_steps, self.stop_reason = plan.step, "data_exhausted"
            start = checkpoints.start_state(plan)
            self._announce(start)
            return start
        # Everything is traced here, under the caller's JAX settings (they are per thread);
        # only XLA's compiles (which release the GIL) run in the pool.
        fresh = checkpoints.fresh_state() if plan.resumed_from is None else None
        with ThreadPoolExecutor(2, thread_name_prefix="jaxtrain-compile") as pool:
            building = pool.submit(fresh.compile) if fresh is not None else None
            step = program.lower_train_step(program.abstract_state(), batch, self.progress)
            compiling = pool.submit(step)
            if building is not None:
                building.result()
            start = checkpoints.start_state(plan, fresh=fresh)  # a failure waits for compiles
            self._announce(start)  # usually before the compile's own line
            self.train_step = compiling.result()
        # What XLA assigned per device: `jaxtrain plan` predicts this figure.
        platform = program.mesh.devices.flat[0].platform
        memory = memory_summary(self.train_step.compiled.executable, platform)
        self.step_memory = memory
        self.trainer.monitor.add_run_info("train_step_memory", memory)
        return start

    def _announce(self, start: RunStart) -> None:
        """The run's first lines, once its state exists (a refused resume prints only its
        error)."""
        trainer, settings, program = self.trainer, self.settings, self.program
        per_step = (
            f"{settings.total_batch_size} examples"
            if program.objective.batch_unit == "examples"
            else f"{settings.total_batch_size} x {settings.max_sequence_length} tokens"
        )
        mesh = program.mesh
        self.progress.write(
            f"jaxtrain: {program.parts.num_parameters / 1e6:.2f}M parameters, "
            f"{self.total_steps} steps, {per_step} per step, "
            f"devices: {mesh.devices.size} x {mesh.devices.flat[0].device_kind}, "
            f"mesh {dict(mesh.shape)}"
        )
        if start.resumed_from is not None:
            self.progress.write(f"resumed from {start.resumed_from} at step {start.step}")
            for note in start.notes if start.step < self.total_steps else []:
                self.progress.write(note)
        summary = startup_summary(program, self.trainer.settings)  # all in run_info.json
        trainer.monitor.add_run_info("startup", summary)
        if trainer.runtime.is_main_process:
            for line in summary_lines(summary):
                self.progress.write(line)

    def _next_batch(self, step: int, state: TrainState):
        """The source's batch for `step`; an offline source's time is a wait for data."""
        if self.source.on_policy:  # sampling from `state` is part of the step's work
            return self.source.next(step, state)
        with self.trainer.monitor.data_wait.timing():
            return self.source.next(step, state)

    # ------------------------------------------------------------------ loop
    def _run_hooks(self, step: int, start: RunStart) -> tuple[EvaluationHook, SaveHook]:
        """Evaluation and saving with their cadences (run_hooks.py). A rerun of a finished run
        (or one killed after its last commit) adds nothing twice."""
        evaluation = EvaluationHook(
            self._evaluate,
            self._eval_steps(),
            self.total_steps,
            self.stop,
            enabled=self._wants_eval(),
            evaluated_step=step if start.evaluated else -1,
        )
        resumed = start.resumed_from is not None
        saving = SaveHook(
            self.trainer.checkpoints.save,
            self.settings.save_steps,
            self.stop,
            evaluation,
            saved_step=step if resumed else -1,
        )
        return evaluation, saving

    def _steps(self, state, step: int, signals: StopSignals, start: RunStart):
        trainer, settings, total_steps = self.trainer, self.settings, self.total_steps
        evaluation, saving = self._run_hooks(step, start)
        run_hooks = HookSet([evaluation, saving])
        window = trainer.monitor.window()
        window.restart_clock()  # the first batch's wait was before the compile
        first_step = step + 1
        self.step = step
        while step < total_steps:
            if trainer.should_stop:
                self.stop_reason = "callback"
                break
            # profile_steps: the trace starts here; starting it is not step time.
            window.exclude(self.profiler.before(step + 1, state))
            # Hooks may hand back a state, a batch, metrics (hooks.py); None changes nothing.
            state = self.hooks.step_start(trainer, state, step)
            if trainer.should_stop:  # set by on_step_start: this step does not run
                self.stop_reason = "callback"
                self._close_window(step, window)
                break
            try:
                taken = self._next_batch(step, state)
            except DataExhausted:
                self._data_ran_out(step, window)
                break
            host_batch = taken.host
            batch, extra_logs = self.hooks.batch(trainer, taken.batch, step)
            extra_logs = {**taken.logs, **extra_logs}
            with self.profiler.annotate(step + 1):
                state, metrics = self.train_step(state, batch)
            self.latest_state = state
            step += 1
            self.step = step
            if step == first_step:
                trainer.monitor.first_step_done(state)
                self.read_step = step
            # The progress watch of a multi-host run (step_timeout_s) counts from the end of
            # the first step: its first execution (allocations, autotuning) is start-up.
            note_progress(step)
            # The previous window's logs go out now that this step is dispatched, and before
            # this step's hooks log anything: trackers such as W&B drop a step that goes back.
            self._emit_pending()
            state, metrics = self.hooks.step_end(trainer, state, metrics, step)
            trainer.monitor.after_step(state, step)
            self.latest_state = state
            self.guard.push(step, metrics["nonfinite"])
            window.add(metrics, trainer.monitor.count(host_batch), extra_logs)
            self._poll_stops(step, signals, saving.last_save_time)
            if self.stop.reason is not None:
                self.stop_reason = self.stop.reason
            last = step == total_steps or self.stop.reason is not None or trainer.should_stop
            if step % settings.logging_steps == 0 or last:
                self._close_window(step, window)
            # The trace stops once this step is done and its window closed: the window is
            # read (one step late) with the step's time in it, the writing of the trace not.
            window.exclude(self.profiler.after(step, state))
            self.progress.update(step)
            if run_hooks.any_due(step):
                # An evaluation or a save is no step: the progress watch waits meanwhile.
                note_progress(step, "hook")
                self._emit_pending()
                self.guard.flush()  # never evaluate or save past an unseen NaN
                run_hooks.call("on_step_end", trainer, state, metrics, step)
                window.restart_clock()
                note_progress(step)
            if self.stop.reason is not None:
                break
        note_progress(step, "hook")  # the last evaluation and save
        self._emit_pending()
        self.guard.flush()
        finished = self.stop_reason in ("completed", "callback", "data_exhausted")
        evaluation.finish(state, step, finished=finished)
        saving.finish(state, step, finished=finished, save_final=settings.save_final)
        self.checkpoint_path = saving.checkpoint_path or self.checkpoint_path
        return state, step

    def _finish(self, state, step: int) -> TrainerOutput:
        trainer = self.trainer
        self.program.return_parameters(state)
        if self.stop_reason.startswith("signal:"):
            signal_name = self.stop_reason.split(":", 1)[1]
            raise TrainingInterrupted(signal_name, step, self.checkpoint_path)
        if self.stop_reason == "time_limit" and trainer.runtime.is_main_process:
            print(
                f"jaxtrain: training_time_limit={self.settings.training_time_limit} reached at "
                f"step {step}; saved {self.checkpoint_path}. Run the same command again to "
                "continue."
            )
        meter = self.source.meter
        for summary in (meter.truncation_summary(), meter.empty_rows_summary()):
            if summary and trainer.runtime.is_main_process:
                logger.warning("jaxtrain: at the end of the run, %s.", summary)
        output = TrainerOutput(
            state=state,
            metrics={**self.last_logs, **self.eval_metrics},
            checkpoint_path=self.checkpoint_path,
            mesh=self.program.mesh,
            stop_reason=self.stop_reason,
        )
        self.hooks.call("on_train_end", trainer, output)
        trainer.monitor.finish(output)
        return output

    # --------------------------------------------------------------- helpers
    def _data_ran_out(self, step: int, window) -> None:
        """A finite source ended before `step + 1`: the run ends after `step`, its last
        window logged, evaluated and saved as a finished run."""
        self.stop_reason = "data_exhausted"
        if self.trainer.runtime.is_main_process:
            self.progress.write(
                f"jaxtrain: the train data ran out after step {step} (a mixture source with "
                "mixture_exhausted='stop'); finishing the run there."
            )
        self._close_window(step, window)

    def _close_window(self, step: int, window) -> None:
        """Close the logging window of the steps up to `step` (none: nothing to log), with
        the data meter's counts now: the batches of its steps, the next one not yet read
        (read when the window is written, they had one batch too many)."""
        if window.steps:
            self.pending = window.close(step, epoch=self.source.epoch(step))
            self.pending_data = self.source.meter.fields()

    def _poll_stops(self, step: int, signals: StopSignals, last_save_time: float) -> None:
        """Sets `self.stop`: the reason to stop after this step (or None) and whether
        save_interval_minutes is due, agreed by every process. With several processes the
        agreement is a collective that waits for the step in flight, so it runs every
        MULTI_HOST_POLL_STEPS steps only."""
        self.stop.reason, self.stop.interval_save_due = None, False
        if preemption_sync_reached(step):  # a SIGTERM JAX's own notifier took, on any process
            self.stop.reason = "signal:SIGTERM"
            return
        if jax.process_count() > 1 and step % MULTI_HOST_POLL_STEPS:
            return
        interval = self.settings.save_interval_minutes
        interval_due = interval is not None and time.monotonic() - last_save_time >= interval * 60
        signal_seen, expired, interval_due = any_process(
            [signals.received is not None, self.deadline.expired(), interval_due]
        )
        self.stop.interval_save_due = interval_due
        if signal_seen:
            self.stop.reason = f"signal:{signals.received or 'SIGTERM'}"
        elif expired:
            self.stop.reason = "time_limit"

    def _emit_pending(self) -> None:
        """Read and write the closed logging window, if any (its step is already done)."""
        if self.pending is None:
            return
        trainer, monitor = self.trainer, self.trainer.monitor
        logs = monitor.step_logs({**self.pending.read(), **self.pending_data})
        # Counted from the window's own flags: the guard reads each flag a step late.
        self.skipped_steps += self.pending.skipped
        self.pending = None
        self.read_step = int(logs["step"])
        if self.skipped_steps:
            logs["nonfinite_skipped_steps"] = self.skipped_steps
        self.log.write(logs["step"], logs)
        self.hooks.call("on_log", trainer, logs, logs["step"])
        self.progress.update(logs["step"], monitor.progress_fields(logs))
        self.last_logs = logs

    def _profile_written(self, record: dict) -> None:
        """The profile_steps trace is on disk: say where, in the log and run_info.json."""
        self.trainer.monitor.add_run_info("profile", record)
        if self.trainer.runtime.is_main_process:
            self.progress.write(profile_line(record))

    def _wants_eval(self) -> bool:
        return self.trainer.evaluates and self.settings.evaluation_strategy != "no"

    def _eval_steps(self) -> int | None:
        """Steps between evaluations: eval_steps, one epoch, or None (no evaluation)."""
        if not self._wants_eval():
            return None
        if self.settings.evaluation_strategy == "steps":
            return self.settings.eval_steps
        return self.source.steps_per_epoch  # "epoch"

    def _evaluate(self, state, step: int) -> None:
        trainer = self.trainer
        self.hooks.call("on_evaluate_start", trainer, state, step)
        metrics = trainer.evaluate(state)
        self.log.write(step, metrics)
        self.hooks.call("on_evaluate", trainer, metrics, step)
        # ppl for token NLLs only, acc when the objective counts `correct`, GRPO's rewards.
        shown = [
            f"{label} {metrics[key]:{spec}}"
            for key, label, spec in (
                ("eval/loss", "loss", ".4f"),
                ("eval/perplexity", "ppl", ".2f"),
                ("eval/accuracy", "acc", ".3f"),
                ("eval/reward", "reward", ".4f"),
            )  # fmt: skip
            if key in metrics
        ]
        shown += [f"{key[5:]} {value:.3f}" for key, value in metrics.items() if "pass@" in key]
        # eval_tasks' scores: the metrics that come with a standard error.
        shown += [
            f"{key[5:]} {value:.3f} ± {metrics[key + '_stderr']:.3f}"
            for key, value in metrics.items()
            if key + "_stderr" in metrics
        ]
        self.progress.write(f"step {step}: eval " + ", ".join(shown))
        self.eval_metrics = metrics
