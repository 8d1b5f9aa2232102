"""Host-side metric bookkeeping for the loop: logging windows and eval summaries.

Losses are token-weighted over the whole window (sum of loss sums / sum of target tokens),
not a mean of per-step means. Throughput counts real target tokens; padded tokens/s (every
position of the batch) is reported beside it so the two are never confused.
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import numpy as np

IGNORE_INDEX = -100


def host_token_count(batch: dict[str, np.ndarray]) -> tuple[int, int, int]:
    """(target tokens, positions, sequences) of a host batch, counted without the device."""
    labels = np.asarray(batch["labels"])
    targets = int((labels[..., 1:] != IGNORE_INDEX).sum())
    sequences = int(np.prod(labels.shape[:-1]))
    return targets, int(labels.size), sequences


class MetricsWindow:
    """Collects the device metrics of the steps between two logging points."""

    def __init__(self) -> None:
        self._metrics: list[dict[str, Any]] = []
        self._counts = np.zeros(3, np.int64)
        self._clock = time.perf_counter()

    def add(self, metrics: dict[str, Any], counts: tuple[int, int, int]) -> None:
        self._metrics.append(metrics)
        self._counts += counts

    def restart_clock(self) -> None:
        """Exclude time spent outside training steps (eval, saving) from throughput."""
        self._clock = time.perf_counter()

    def close(self, step: int, *, epoch: float) -> _ClosedWindow:
        closed = _ClosedWindow(self, self._metrics, self._counts.copy(), step, epoch)
        self._metrics, self._counts = [], np.zeros(3, np.int64)
        return closed


class _ClosedWindow:
    def __init__(self, window: MetricsWindow, metrics, counts, step: int, epoch: float):
        self._window, self._metrics, self._counts = window, metrics, counts
        self.step, self.epoch = step, epoch

    def read(self) -> dict[str, float]:
        """Wait for the window's last step, then summarise it."""
        values = jax.device_get(self._metrics)
        now = time.perf_counter()
        elapsed = max(now - self._window._clock, 1e-9)
        self._window._clock = now
        tokens = sum(float(v["tokens"]) for v in values)
        loss = sum(float(v["loss_sum"]) for v in values) / max(tokens, 1.0)
        targets, positions, sequences = (int(c) for c in self._counts)
        logs = {
            "step": self.step,
            "epoch": round(self.epoch, 4),
            "loss": loss,
            "perplexity": math.exp(min(loss, 80.0)),
            "accuracy": sum(float(v["correct"]) for v in values) / max(tokens, 1.0),
            "learning_rate": float(values[-1]["learning_rate"]),
            "grad_norm": float(values[-1]["grad_norm"]),
            "step_time_s": elapsed / len(values),
            "tokens_per_second": targets / elapsed,
            "padded_tokens_per_second": positions / elapsed,
            "sequences_per_second": sequences / elapsed,
        }
        return logs


def eval_summary(totals: dict[str, float], sums: dict[str, Any], batches: int) -> dict[str, float]:
    """Add one eval batch's sums into `totals` and return the running metrics."""
    for key, value in sums.items():
        totals[key] = totals.get(key, 0.0) + float(value)
    tokens = max(totals.get("tokens", 0.0), 1.0)
    loss = totals["loss_sum"] / tokens
    return {
        "eval/loss": loss,
        "eval/perplexity": math.exp(min(loss, 80.0)),
        "eval/accuracy": totals.get("correct", 0.0) / tokens,
        "eval/tokens": totals.get("tokens", 0.0),
        "eval/batches": batches,
    }
