"""RunMonitor: everything the loop reports about a run, behind a few calls.

The Trainer creates one (trackers are checked then) and the loop calls it at these points:

    log = monitor.open(out_dir, start_step, tracker_state)   # trackers start (process 0);
                                                             # log.write(step, values) fans out
    step = monitor.jit(fn, "train_step", progress=bar, ...)  # a TrackedJit: every compile is
                                                             # timed, logged and checked
    batches = monitor.timed(batches)             # the data wait is timed
    monitor.first_step_done(state)               # time to the first step; run_info.json
    window = monitor.window()                    # throughput, TFLOP/s, MFU of a log window
    window.add(metrics, monitor.count(host_batch))
    logs = monitor.step_logs(window.close(...).read())   # + memory, + a stale CPU peak probed
    monitor.progress_fields(logs)                # what the progress bar shows
    monitor.tracker_state()                      # stored in checkpoints ("trackers")

It is also a TrainerCallback (weight statistics at on_step_end, the run report at
on_train_end). Only process 0 writes anything.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxtrain.config.sections import MonitorSettings
from jaxtrain.objective import Difference
from jaxtrain.observability import weights
from jaxtrain.observability.compiles import CompileEvent, TrackedJit
from jaxtrain.observability.flops import FlopsCounter, matmul_parameters
from jaxtrain.observability.hardware import PeakFlops, cpu_shares, device_peak, remeasure_cpu_peak
from jaxtrain.observability.metrics import (
    BatchCounts,
    DataWaitClock,
    MetricsWindow,
    host_token_count,
)
from jaxtrain.observability.trackers import check_trackers, default_run_name, start_trackers

GIB = 2.0**30
logger = logging.getLogger("jaxtrain.observability")


class MonitorLog:
    """The loop's metric log: `write(step, values)` goes to every started tracker.

    Compiles report from a compile thread while the loop writes from the main one: a lock
    keeps each record whole in trackers whose writers are not thread-safe."""

    def __init__(self, trackers: list[Any], before_close: list[Any] | None = None):
        self.trackers = trackers
        self._before_close = before_close or []
        self._lock = threading.Lock()

    def write(self, step: int, values: dict[str, Any]) -> None:
        with self._lock:
            for tracker in self.trackers:
                tracker.log(step, values)

    def log_histograms(self, step: int, histograms: dict[str, dict[str, Any]]) -> None:
        with self._lock:
            for tracker in self.trackers:
                tracker.log_histograms(step, histograms)

    def close(self) -> None:
        for callback in self._before_close:
            callback()
        self._before_close = []
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def memory_logs() -> dict[str, float]:
    """Device memory (where the backend reports it) and this process's resident memory."""
    logs: dict[str, float] = {}
    stats = []
    for device in jax.local_devices():
        try:
            stats.append(device.memory_stats() or {})
        except Exception:  # backends without memory stats raise or return None
            stats.append({})
    for key, name in (("bytes_in_use", "in_use"), ("peak_bytes_in_use", "peak")):
        values = [s[key] for s in stats if key in s]
        if values:
            logs[f"memory/device_{name}_gib"] = max(values) / GIB
    limits = [s["bytes_limit"] for s in stats if "bytes_limit" in s]
    if limits:
        logs["memory/device_limit_gib"] = min(limits) / GIB
    try:
        import psutil

        logs["memory/host_rss_gib"] = psutil.Process().memory_info().rss / GIB
    except ImportError:
        pass
    return logs


class RunMonitor:
    def __init__(
        self,
        settings: MonitorSettings,
        *,
        model_config: Any,
        num_parameters: int,
        num_devices: int | None = None,
        compiler_options: dict[str, Any] | None = None,
        perplexity: bool = True,
        batch_unit: str = "tokens",
        differences: Sequence[Difference] = (),
    ):
        self.settings = settings
        self.batch_unit = batch_unit  # what throughput counts: "tokens" or "examples"
        self.perplexity = perplexity  # log exp(loss): the loss is a per-token NLL
        self.differences = tuple(differences)  # logged differences of means (objective.py)
        self.compiler_options = compiler_options  # XLA options of every compile of the run
        # The devices the run's mesh spans (a Trainer may be given a subset of jax.devices()):
        # TFLOP/s and MFU are per device of the mesh.
        self.num_devices = jax.device_count() if num_devices is None else num_devices
        self.is_writer = jax.process_index() == 0
        self.flops = FlopsCounter(model_config, num_parameters)
        self.num_parameters = num_parameters
        # A resumed run's metadata["trackers"] (given to `open`): same TB dir, W&B run.
        self._resume_state: dict[str, Any] = {}
        self.run_name: str | None = None
        self.data_wait = DataWaitClock()
        self._log = MonitorLog([])
        self._trackers: list[Any] = []
        self._step = 0
        self._weight_fn: TrackedJit | None = None
        self._pending_weights: tuple[int, Any] | None = None
        self._peak: tuple[str, PeakFlops] | None = None
        self._window: MetricsWindow | None = None
        self._run_info_dir: Path | None = None  # run_info.json still to write there
        self._out_dir: Path | None = None  # where run_info.json is rewritten (a new peak)
        self._warned_peak = False
        # Sections the loop adds to run_info.json (the start-up summary), add_run_info().
        self.run_info_extra: dict[str, Any] = {}
        if self.is_writer:
            check_trackers(settings.report_to, settings.output_dir)

    # ------------------------------------------------------------ startup
    def open(
        self, out_dir: str | Path, start_step: int, tracker_state: dict[str, Any] | None = None
    ) -> MonitorLog:
        """Start the trackers; `tracker_state` (what `tracker_state()` returned when the
        resumed checkpoint was saved) continues their runs."""
        self._step = start_step
        self._resume_state = dict(tracker_state or {})
        self.run_name = self._resume_state.get("run_name") or self.settings.run_name
        self.run_name = self.run_name or default_run_name()
        if not self.is_writer:
            return self._log
        out_dir = Path(out_dir)
        self._trackers = start_trackers(
            self.settings.report_to,
            out_dir,
            run_name=self.run_name,
            project=self.settings.project_name,
            config=self.settings.config,
            start_step=start_step,
            resume=self._resume_state,
        )
        self._log = MonitorLog(
            self._trackers, before_close=[self._flush_weights, self._ensure_run_info]
        )
        # run_info.json holds the device's peak FLOP/s, which on a CPU is measured: that
        # waits until the first step is done (first_step_done) instead of delaying it.
        self._run_info_dir = self._out_dir = out_dir
        return self._log

    def first_step_done(self, state: Any) -> None:
        """After the run's first step: measure the CPU peak (on an idle device: waits for the
        step), give it to the open window without counting the probe, write run_info.json.
        The wait for the step is step time and stays in the window: excluding it made a
        one-step window's time ~0 and its FLOP/s absurd (2.2e14 on 2 cores)."""
        jax.block_until_ready(state)
        start = time.perf_counter()
        _ = self.peak
        if self._window is not None:
            self._window.peak_flops = self.peak[1]
            self._window.exclude(time.perf_counter() - start)
        self._ensure_run_info()

    def _ensure_run_info(self) -> None:
        if self._run_info_dir is not None:
            out_dir, self._run_info_dir = self._run_info_dir, None
            self._write_run_info(out_dir)

    def _write_run_info(self, out_dir: Path) -> None:
        description, peak_info = self.peak_info
        peak = peak_info.flops
        seq = self.settings.max_sequence_length
        info = {
            "run_name": self.run_name,
            "device": description,
            "device_kind": jax.devices()[0].device_kind,
            "num_devices": self.num_devices,
            "peak_tflops_per_device": peak / 1e12 if peak else None,
            "peak": peak_info.to_json(),  # per device, and where the number came from
            "num_parameters": self.num_parameters,
            "flops_formula": "exact" if self.flops.exact else "6 * num_parameters",
            "flops_per_token_at_max_sequence_length": self.flops.per_token(seq),
            "report_to": ["jsonl", *[t for t in self.settings.report_to if t != "jsonl"]],
        }
        if self.flops.exact:
            info["matmul_parameters"] = matmul_parameters(self.flops.config)
        info.update(self.run_info_extra)
        (out_dir / "run_info.json").write_text(json.dumps(info, indent=2) + "\n")

    def add_run_info(self, key: str, value: Any) -> None:
        """A JSON-ready section of run_info.json, written with the rest of it (now, when
        the file is already written)."""
        self.run_info_extra[key] = value
        if self.is_writer and self._run_info_dir is None and self._out_dir is not None:
            self._write_run_info(self._out_dir)

    @property
    def peak(self) -> tuple[str, float | None]:
        """(device description, peak FLOP/s per device or None)."""
        description, info = self.peak_info
        return description, info.flops

    @property
    def peak_info(self) -> tuple[str, PeakFlops]:
        if self._peak is None:
            self._peak = device_peak()
        return self._peak

    def tracker_state(self) -> dict[str, Any]:
        """What a resumed run needs to continue the same tracker runs (checkpoint metadata)."""
        state: dict[str, Any] = {"run_name": self.run_name}
        for tracker in self._trackers:
            if tracker.state():
                state[tracker.name] = tracker.state()
        return state

    # ------------------------------------------------------------ per step
    def timed(self, batches: Any) -> Any:
        return self.data_wait.timed(iter(batches))

    def window(self) -> MetricsWindow:
        peak = self._peak[1].flops if self._peak is not None else None  # see first_step_done
        self._window = MetricsWindow(
            num_devices=self.num_devices,
            peak_flops=peak,
            data_wait=self.data_wait,
            perplexity=self.perplexity,
            unit=self.batch_unit,
            differences=self.differences,
        )
        return self._window

    def count(self, host_batch: dict[str, Any]) -> BatchCounts:
        """Counts of this process's share, scaled to the global batch. Every process holds
        as many rows; with several processes padding may differ between them, so multi-host
        throughput is an estimate (the loss is exact)."""
        counts = host_token_count(host_batch, self.flops)
        processes = jax.process_count()
        return counts if processes == 1 else BatchCounts(*(c * processes for c in counts))

    def jit(self, fn: Any, name: str, *, progress: Any = None, **jit_kwargs: Any) -> TrackedJit:
        """`jax.jit(fn, **jit_kwargs)` whose compiles are logged (and recompiles warned)."""

        def report(event: CompileEvent) -> None:
            self._log.write(
                self._step,
                {f"compile/{name}_s": event.seconds, f"compile/{name}_count": event.count},
            )
            if progress is not None:
                progress.write(event.message())
            if self._window is not None:
                self._window.exclude(event.seconds)  # compile time is not step time

        return TrackedJit(
            fn,
            name,
            report,
            compiler_options=self.compiler_options,
            on_event_shows=progress is not None,  # the progress prints it: not the logger too
            **jit_kwargs,
        )

    def step_logs(self, logs: dict[str, float]) -> dict[str, float]:
        """A closed window's logs plus memory (track_memory); an MFU above 100% first
        corrects the peak (`_check_peak`)."""
        self._check_peak(logs)
        if self.settings.track_memory:
            logs.update(memory_logs())
        return logs

    def _check_peak(self, logs: dict[str, float]) -> None:
        """A window that achieved more FLOP/s than the peak proves the peak wrong. A measured
        CPU peak (taken under load) is probed again and raised to at least what the run
        achieved; run_info.json says so. Any other peak (table, JAXTRAIN_CPU_PEAK_TFLOPS) is
        warned about once; MFU is clamped to 1 as the last guard."""
        if "mfu" not in logs or self._peak is None or not self._peak[1].flops:
            return
        description, info = self._peak
        achieved = logs["tflops_per_device"] * 1e12
        if achieved <= info.flops:
            return
        if jax.devices()[0].platform == "cpu" and info.source != "environment":
            start = time.perf_counter()
            shares = cpu_shares()
            machine = remeasure_cpu_peak(achieved * shares)
            info = PeakFlops(machine.flops / shares, machine.source, machine.measured_at)
            self._peak = (description, info)
            if self._window is not None:  # the probe's seconds are not step time
                self._window.peak_flops = info.flops
                self._window.exclude(time.perf_counter() - start)
            if self.is_writer and self._run_info_dir is None and self._out_dir is not None:
                self._write_run_info(self._out_dir)
        elif not self._warned_peak:
            self._warned_peak = True
            logger.warning(
                "The run achieved %.3g TFLOP/s per device, above the %s peak of %s (%s): the "
                "peak is too low, so MFU is logged as at most 100%%. Fix the peak (e.g. "
                "JAXTRAIN_CPU_PEAK_TFLOPS) for a meaningful MFU.",
                achieved / 1e12,
                info.source,
                description,
                f"{info.flops / 1e12:.3g} TFLOP/s",
            )
        logs["mfu"] = min(achieved / info.flops, 1.0)

    @staticmethod
    def progress_fields(logs: dict[str, float]) -> dict[str, Any]:
        """Step and ETA are the bar's own; these go beside them."""
        fields: dict[str, Any] = {"epoch": round(float(logs.get("epoch", 0.0)), 2)}
        names = {
            "loss": "loss",
            "learning_rate": "lr",
            "tokens_per_second": "tok/s",
            "examples_per_second": "ex/s",
        }
        fields.update({short: logs[key] for key, short in names.items() if key in logs})
        if "mfu" in logs:
            fields["mfu"] = f"{100 * logs['mfu']:.1f}%"
        return fields

    # ------------------------------------------------------ the loop's calls
    def after_step(self, state: Any, step: int) -> None:
        """After every step (the loop calls it after the run's hooks): weight statistics."""
        self._step = step
        every = self.settings.weight_distribution_log_steps
        if not every:
            return
        # Every process runs the (SPMD) statistics; only process 0's log writes them.
        self._flush_weights()  # the previous statistics, computed a step ago
        if step % every == 0:
            if self._weight_fn is None:
                fn = weights.make_weight_stats_fn(state.params)
                self._weight_fn = self.jit(fn, "weight_stats")
            self._pending_weights = (step, self._weight_fn(state.params))

    def _flush_weights(self) -> None:
        if self._pending_weights is None:
            return
        step, stats = self._pending_weights
        self._pending_weights = None
        stats = jax.device_get(stats)
        self._log.write(step, weights.scalar_logs(stats))
        self._log.log_histograms(
            step, {group: weights.histogram(values) for group, values in stats.items()}
        )

    def finish(self, output: Any) -> None:
        """When the run ends (after the run's hooks): the report."""
        if self.is_writer and self.settings.run_report:
            from jaxtrain.observability.report import ReportError, write_report

            try:
                result = write_report(self.settings.output_dir)
            except Exception as err:  # asked for and not written: say so, with the way out
                raise ReportError(
                    f"training finished (checkpoint: {output.checkpoint_path}), but the run "
                    f"report could not be written to {self.settings.output_dir}: "
                    f"{type(err).__name__}: {err}. Fix the cause and run `jaxtrain report "
                    f"{self.settings.output_dir}`, or pass run_report=False."
                ) from err
            print(f"jaxtrain: run report: {result.html}")
