"""Progress display: rich (default), tqdm, json lines (for log collectors) or none.

rich and tqdm redraw a bar in place, so they are used only when the stream is a terminal;
anywhere else (a log file, a pipe) the same fields come as one plain line per logged step.

Each shows the step out of the total and the ETA itself; the loop passes the rest at logging
cadence (RunMonitor.progress_fields: epoch, loss, lr, tokens/s, MFU)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


class NoProgress:
    def __init__(self, total: int, initial: int = 0, stream: TextIO | None = None):
        self.total = total
        self.stream = stream or sys.stderr

    def update(self, step: int, postfix: dict[str, Any] | None = None) -> None: ...

    def write(self, message: str) -> None:
        print(message, file=self.stream, flush=True)

    def close(self) -> None: ...


class SilentProgress(NoProgress):
    """What every process but process 0 of a cluster shows: nothing, not even the messages
    (start, resume, compile, eval lines); process 0 speaks for the run."""

    def write(self, message: str) -> None: ...


class LineProgress(NoProgress):
    """Plain log lines, one per logged step: what rich/tqdm become outside a terminal (a log
    file, a pipe, a batch job), where a redrawn bar would squeeze into one unreadable line."""

    def __init__(self, total: int, initial: int = 0, stream: TextIO | None = None):
        super().__init__(total, initial, stream)
        self._start, self._initial = time.perf_counter(), initial

    def update(self, step: int, postfix: dict[str, Any] | None = None) -> None:
        if postfix:
            elapsed = time.perf_counter() - self._start
            eta = elapsed / max(step - self._initial, 1) * (self.total - step)
            fields = " ".join(f"{k}={_fmt(v)}" for k, v in postfix.items())
            line = f"train {step}/{self.total} eta {_clock(eta)} {fields}"
            print(line, file=self.stream, flush=True)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class JsonProgress(NoProgress):
    """One JSON object per logged step on stdout; nothing per unlogged step."""

    def __init__(self, total: int, initial: int = 0, stream: TextIO | None = None):
        super().__init__(total, initial, stream or sys.stdout)
        self._start = time.perf_counter()
        self._initial = initial

    def update(self, step: int, postfix: dict[str, Any] | None = None) -> None:
        if postfix:
            elapsed = time.perf_counter() - self._start
            done = max(step - self._initial, 1)
            eta = elapsed / done * (self.total - step)
            record = {"step": step, "total": self.total, "eta_s": round(eta, 1), **postfix}
            print(json.dumps(record), file=self.stream, flush=True)

    def write(self, message: str) -> None:
        print(json.dumps({"message": message}), file=self.stream, flush=True)


class TqdmProgress(NoProgress):
    def __init__(self, total: int, initial: int = 0, stream: TextIO | None = None):
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total, initial=initial, desc="train", file=stream, dynamic_ncols=True
        )

    def update(self, step: int, postfix: dict[str, Any] | None = None) -> None:
        self._bar.update(step - self._bar.n)
        if postfix:
            self._bar.set_postfix({k: _fmt(v) for k, v in postfix.items()}, refresh=False)

    def write(self, message: str) -> None:
        self._bar.write(message)

    def close(self) -> None:
        self._bar.close()


class RichProgress(NoProgress):
    def __init__(self, total: int, initial: int = 0, stream: TextIO | None = None):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._console = Console(file=stream or sys.stderr)
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[postfix]}"),
            console=self._console,
            refresh_per_second=4,
        )
        self._task = self._progress.add_task("train", total=total, completed=initial, postfix="")
        self._progress.start()

    def update(self, step: int, postfix: dict[str, Any] | None = None) -> None:
        fields = {}
        if postfix:
            fields["postfix"] = " ".join(f"{k}={_fmt(v)}" for k, v in postfix.items())
        self._progress.update(self._task, completed=step, **fields)

    def write(self, message: str) -> None:
        self._progress.console.print(message, markup=False, highlight=False)

    def close(self) -> None:
        self._progress.stop()


PROGRESS_CLASSES = {"rich": RichProgress, "tqdm": TqdmProgress, "json": JsonProgress}
INTERACTIVE = ("rich", "tqdm")  # redraw in place: only in a terminal


def make_progress(
    kind: str, total: int, initial: int = 0, stream: TextIO | None = None, *, primary: bool = True
):
    """The display for `progress_bar`; rich/tqdm fall back to plain lines outside a TTY.
    Not `primary` (a cluster's process > 0): silent, whatever the kind."""
    if not primary:
        return SilentProgress(total, initial, stream)
    stream = stream or (sys.stdout if kind == "json" else sys.stderr)
    if kind in INTERACTIVE and not _is_terminal(stream):
        return LineProgress(total, initial, stream)
    return PROGRESS_CLASSES.get(kind, NoProgress)(total, initial, stream)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
