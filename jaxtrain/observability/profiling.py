"""A jax.profiler trace of chosen training steps (`profile_steps`), one per process.

`profile_steps=[10, 12]` (CLI `--profile_steps 10-12`) traces steps 10, 11 and 12 as the
log counts them, and nothing else: before step 10 is dispatched the loop waits for the step
in flight (its device work would otherwise run inside the trace), and after step 12 it
waits for that step to finish before the trace stops. Each step is a
`jax.profiler.StepTraceAnnotation("train", step_num=n)`, the span xprof's step view and
Perfetto show per step. Outside the window the loop pays two integer comparisons a step.
Starting and stopping the trace (writing it takes a second or more) is left out of the
throughput the run logs; the waits at the window's edges are the steps' own time.

Each process writes `<output_dir>/profile/process_<i>/plugins/profile/<time>/`: the
`<host>.xplane.pb` that xprof and TensorBoard's profile plugin read (`--logdir` the
process's directory) and `perfetto_trace.json.gz` for ui.perfetto.dev. The run's
run_info.json ("profile") and its report name them.

The field is read (CLI "10-12" -> [10, 12]) and checked with the rest of the configuration
(config/tables.py, parse_profile_steps); a window past the run's end is refused when the
run's length is known (`check_steps`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxtrain.errors import ArgumentError


class StepProfiler:
    """The loop's profiler: `before(n, state)` and `annotate(n)` around the dispatch of step
    n, `after(n, state)` once it is dispatched, `close()` when the loop ends."""

    def __init__(
        self,
        steps: list[int] | None,
        output_dir: str | Path,
        process_index: int,
        *,
        announce: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.first, self.last = steps if steps else (0, -1)
        self.directory = Path(output_dir).absolute() / "profile" / f"process_{process_index}"
        self.announce = announce  # given the record of the trace once it is written
        self.started_at: int | None = None  # the first step traced
        self.record: dict[str, Any] | None = None

    @property
    def enabled(self) -> bool:
        return self.last >= self.first

    def check_steps(self, start_step: int, total_steps: int) -> None:
        """An error for a window past the run's end (a profile that never comes)."""
        if self.enabled and self.last > total_steps:
            raise ArgumentError(
                f"TrainingArguments.profile_steps=[{self.first}, {self.last}] ends after the "
                f"run's last step ({total_steps}): choose steps between 1 and {total_steps}."
            )
        del start_step  # a resumed run traces what is left of the window (before)

    def before(self, step: int, state: Any) -> float:
        """Step `step` is about to run: start the trace at the window's first step (or the
        first step of a run resumed inside the window). Returns the seconds the profiler
        itself took (not step time: the loop leaves them out of its throughput)."""
        if self.started_at is not None or self.record is not None:
            return 0.0
        if not self.first <= step <= self.last:
            return 0.0
        import jax

        # Everything in flight stays out of the trace: the step, and the metrics and logs
        # dispatched after it, which under load could still be running when the trace starts.
        jax.block_until_ready((state, jax.live_arrays()))
        began = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
        self.started_at = step
        return time.perf_counter() - began

    def annotate(self, step: int) -> contextlib.AbstractContextManager:
        if self.started_at is None:
            return contextlib.nullcontext()
        import jax

        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, state: Any) -> float:
        """Step `step` is dispatched (and its logging window closed): at the window's last,
        wait for it and stop. Returns the seconds the stop took (writing the trace)."""
        if self.started_at is None or step < self.last:
            return 0.0
        import jax

        # The last step and what was dispatched after it (its metrics) end inside the trace.
        jax.block_until_ready((state, jax.live_arrays()))
        began = time.perf_counter()
        self._stop(step)
        return time.perf_counter() - began

    def close(self) -> None:
        """The loop ends (early stop, an error) inside the window: keep what was traced."""
        if self.started_at is not None:
            self._stop(None)

    def _stop(self, last: int | None) -> None:
        import jax

        first, self.started_at = self.started_at, None
        jax.profiler.stop_trace()
        self.record = {
            "steps": [first, last] if last is not None else [first, None],
            "directory": str(self.directory),
            **trace_files(self.directory),
        }
        if self.announce is not None:
            self.announce(self.record)


def trace_files(directory: Path) -> dict[str, str | None]:
    """The newest trace's xplane.pb (xprof, TensorBoard) and Perfetto file under `directory`."""
    runs = sorted((directory / "plugins" / "profile").glob("*"), key=lambda p: p.stat().st_mtime)
    newest = runs[-1] if runs else directory
    xplane = next(iter(sorted(newest.glob("*.xplane.pb"))), None)
    perfetto = newest / "perfetto_trace.json.gz"
    return {
        "xplane": str(xplane) if xplane else None,
        "perfetto": str(perfetto) if perfetto.is_file() else None,
    }


def profile_line(record: dict[str, Any]) -> str:
    """The line the run prints when its trace is written."""
    first, last = record["steps"]
    steps = f"steps {first}-{last}" if last is not None else f"steps {first}- (cut short)"
    perfetto = f"; Perfetto: {record['perfetto']}" if record.get("perfetto") else ""
    return (
        f"jaxtrain: profile of {steps} written to {record['directory']} (xprof / TensorBoard's "
        f"profile plugin: --logdir {record['directory']}{perfetto})"
    )
