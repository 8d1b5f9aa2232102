"""Host-side metric bookkeeping for the loop: logging windows and eval summaries.

Losses are token-weighted over the whole window (sum of loss sums / sum of target tokens),
not a mean of per-step means. Throughput counts real target tokens; padded tokens/s (every
position of the batch) is reported beside it so the two are never confused. Model FLOPs
count real tokens only (see flops.py), so MFU does not reward padding.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxtrain.data.collate import IGNORE_INDEX
from jaxtrain.objective import STATE_KEYS, STEP_KEYS, Difference, summarize_sums


class BatchCounts(NamedTuple):
    """What one host batch contributes to throughput, counted without the device."""

    targets: int  # tokens that carry a loss (real, non-padding targets)
    positions: int  # every position of the batch, padding included
    sequences: int
    flops: float = 0.0  # model FLOPs of the batch's real tokens (flops.py); 0 when unknown


def host_token_count(batch: dict[str, np.ndarray], flops: Any = None) -> BatchCounts:
    """Counts of a host batch; `flops` is a FlopsCounter (or None: no FLOPs counted)."""
    if "input_ids" not in batch and "labels" in batch and "pixel_values" in batch:
        # One label per example (image classification): an example is the unit.
        labels = np.asarray(batch["labels"])
        return BatchCounts(int((labels >= 0).sum()), int(labels.size), int(labels.size), 0.0)
    # Preference pairs (task trainers) carry a second sequence per row: "rejected_labels".
    sides = [np.asarray(batch[k]) for k in ("labels", "rejected_labels") if k in batch]
    targets = sum(int((labels[..., 1:] != IGNORE_INDEX).sum()) for labels in sides)
    sequences = sum(int(np.prod(labels.shape[:-1])) for labels in sides)
    model_flops = flops.batch_flops(batch) if flops is not None else 0.0
    return BatchCounts(targets, sum(int(labels.size) for labels in sides), sequences, model_flops)


class DataWaitClock:
    """Seconds the loop spent waiting for the next batch; `timed` wraps a batch iterator."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, batches: Iterator[Any]) -> Iterator[Any]:
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.seconds += time.perf_counter() - start
            yield batch

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Count the time inside as waiting for data."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class MetricsWindow:
    """Collects the device metrics of the steps between two logging points.

    With `peak_flops` (per device) and `num_devices`, a window also reports TFLOP/s per
    device and MFU = achieved model FLOP/s per device / peak; with peak None, no MFU.
    """

    def __init__(
        self,
        *,
        num_devices: int = 1,
        peak_flops: float | None = None,
        data_wait: DataWaitClock | None = None,
        perplexity: bool = True,
        unit: str = "tokens",
        differences: Sequence[Difference] = (),
    ) -> None:
        self._metrics: list[dict[str, Any]] = []
        # What a batch's "targets" count: target tokens, or examples (image classification,
        # whose throughput is examples/s and has no tokens or padding).
        self.unit = unit
        self._extra_logs: dict[str, Any] = {}
        self.perplexity = perplexity  # the loss is a per-token NLL (objective.py)
        self.differences = tuple(differences)  # logged differences of means (objective.py)
        self._counts = np.zeros(4, np.float64)
        self._clock = time.perf_counter()
        self.num_devices = num_devices
        self.peak_flops = peak_flops
        self.data_wait = data_wait or DataWaitClock()

    def add(
        self,
        metrics: dict[str, Any],
        counts: tuple[float, ...],
        extra_logs: dict[str, Any] | None = None,
    ) -> None:
        """One step's device metrics and counts; `extra_logs` (numbers, e.g. from a batch
        hook) are logged as they are, the window's last value of each key."""
        self._metrics.append(metrics)
        self._counts[: len(counts)] += counts
        self._extra_logs.update(extra_logs or {})

    @property
    def steps(self) -> int:
        """Steps added since the window last closed."""
        return len(self._metrics)

    def restart_clock(self) -> None:
        """Exclude time spent outside training steps (eval, saving) from throughput."""
        self._clock = time.perf_counter()
        self.data_wait.take()

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` of host work done inside the window (a compile) out of its time."""
        self._clock += seconds

    def close(self, step: int, *, epoch: float) -> _ClosedWindow:
        closed = _ClosedWindow(self, self._metrics, self._counts.copy(), step, epoch)
        closed.data_wait_s = self.data_wait.take()
        closed.extra_logs = self._extra_logs
        self._metrics, self._counts, self._extra_logs = [], np.zeros(4, np.float64), {}
        return closed


class _ClosedWindow:
    def __init__(self, window: MetricsWindow, metrics, counts, step: int, epoch: float):
        self._window, self._metrics, self._counts = window, metrics, counts
        self.step, self.epoch = step, epoch
        self.data_wait_s = 0.0
        self.extra_logs: dict[str, Any] = {}
        self.skipped = 0  # its steps whose update was skipped (NaN/Inf), once read

    def read(self) -> dict[str, float]:
        """Wait for the window's last step, then summarise it."""
        values, extra = jax.device_get((self._metrics, self.extra_logs))
        now = time.perf_counter()
        elapsed = max(now - self._window._clock, 1e-9)
        self._window._clock = now
        totals: dict[str, float] = {}
        for step_values in values:  # every sum the objective returned (objective.py)
            for key, value in step_values.items():
                if key not in STEP_KEYS:
                    totals[key] = totals.get(key, 0.0) + float(value)
        targets, positions, sequences, flops = (float(c) for c in self._counts)
        steps = len(values)
        summary = summarize_sums(
            totals, perplexity=self._window.perplexity, differences=self._window.differences
        )
        self.skipped = sum(bool(v.get("nonfinite", False)) for v in values)
        if self.skipped == steps:  # a skipped step's sums are zeroed: 0/0 read as a loss of 0
            summary = dict.fromkeys(summary, float("nan"))
        logs = {
            "step": self.step,
            "epoch": round(self.epoch, 4),
            **summary,
            "learning_rate": float(values[-1]["learning_rate"]),
            "grad_norm": float(values[-1]["grad_norm"]),
            "step_time_s": elapsed / steps,
            "data_wait_s": self.data_wait_s / steps,
            "data_wait_fraction": min(self.data_wait_s / elapsed, 1.0),
        }
        if self._window.unit == "examples":
            logs["examples_per_second"] = targets / elapsed
        else:
            logs["tokens_per_second"] = targets / elapsed
            logs["padded_tokens_per_second"] = positions / elapsed
            logs["sequences_per_second"] = sequences / elapsed
        logs.update({key: float(values[-1][key]) for key in STATE_KEYS if key in values[-1]})
        logs.update({key: float(value) for key, value in extra.items()})
        if flops > 0:
            per_device = flops / elapsed / self._window.num_devices
            logs["tflops_per_device"] = per_device / 1e12
            if self._window.peak_flops:
                # At most 1: a faster run means a stale peak, which the monitor corrects;
                # this is the last guard, not the fix.
                logs["mfu"] = min(per_device / self._window.peak_flops, 1.0)
        return logs


def eval_summary(
    totals: dict[str, float],
    sums: dict[str, Any],
    batches: int,
    *,
    perplexity: bool = True,
    differences: Sequence[Difference] = (),
) -> dict[str, float]:
    """Add one eval batch's sums into `totals` and return the running metrics: the
    objective's keys under `eval/` by the rule of objective.py, plus tokens and batches."""
    for key, value in sums.items():
        totals[key] = totals.get(key, 0.0) + float(value)
    return {
        **summarize_sums(totals, prefix="eval/", perplexity=perplexity, differences=differences),
        "eval/tokens": totals.get("tokens", 0.0),
        "eval/batches": batches,
    }
