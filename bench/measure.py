"""What every variant of overhead.py shares: the model shapes, the rows, the step clock.

Imported by overhead.py and by the workers that run in other interpreters
(easydel_worker.py, cli_worker.py): numpy and psutil only, never jaxtrain (jax is imported
inside StepClock when a step is timed).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from handwritten_llama import LlamaShape  # noqa: E402 - bench/ is not a package

SIZES = {
    "S1": LlamaShape(
        vocab=4096, hidden=256, intermediate=1024, layers=4, heads=4, seq=256, batch=8
    ),
    "S2": LlamaShape(
        vocab=4096, hidden=512, intermediate=2048, layers=8, heads=8, seq=512, batch=4
    ),
    # Tiny shape for --check only.
    "T": LlamaShape(vocab=128, hidden=64, intermediate=128, layers=2, heads=4, seq=32, batch=4),
}
DEFAULT_STEPS = {"S1": 30, "S2": 12, "T": 4}
LEARNING_RATE = 3e-4
SEED = 0
RESULT_PREFIX = "BENCH_RESULT "


def make_tokens(shape: LlamaShape, steps: int, seed: int = SEED) -> np.ndarray:
    """Random token ids [steps * batch, seq]: exactly one pass over the rows."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, shape.vocab, size=(steps * shape.batch, shape.seq), dtype=np.int32)


def cpu_sample() -> tuple[float, float, float]:
    """(busy CPU s of the whole machine, steal s, CPU s of this process) for contention checks."""
    with open("/proc/stat") as f:
        fields = [float(x) / os.sysconf("SC_CLK_TCK") for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    own = psutil.Process().cpu_times()
    return user + nice + system + irq + softirq, steal, own.user + own.system


class StepClock:
    """Blocks on the state after step 1, W and N (only there) and keeps the timestamps."""

    def __init__(self, start: float, warmup: int, steps: int):
        self.start, self.warmup, self.steps = start, warmup, steps
        self.marks: dict[str, float] = {}
        self.cpu: dict[str, tuple[float, float, float]] = {}
        self.losses: list = []  # device values, read once at the end

    def mark(self, name: str) -> None:
        self.marks[name] = time.time() - self.start

    def after_step(self, step: int, state, loss) -> None:
        import jax

        self.losses.append(loss)
        if step in (1, self.warmup, self.steps):
            jax.block_until_ready(state)
            now = time.time()
            if step == 1:
                self.marks["first_step_s"] = now - self.start
            if step == self.warmup:
                self.marks["t_warm"], self.cpu["warm"] = now, cpu_sample()
            if step == self.steps:
                self.marks["t_end"], self.cpu["end"] = now, cpu_sample()

    def summary(self, shape: LlamaShape) -> dict:
        import jax

        # Trainer steps give (loss_sum, tokens) pairs, the bare loops the mean loss.
        values = jax.device_get(self.losses)
        losses = [float(v[0]) / float(v[1]) if isinstance(v, tuple) else float(v) for v in values]
        seconds = self.marks["t_end"] - self.marks["t_warm"]
        tokens = (self.steps - self.warmup) * shape.batch * shape.seq
        busy, steal, own = (b - a for a, b in zip(self.cpu["warm"], self.cpu["end"]))
        capacity = seconds * (os.cpu_count() or 1) / 100  # CPU seconds per percent
        return {
            "first_step_s": self.marks["first_step_s"],
            "imports_s": self.marks["imports_s"],
            "setup_s": self.marks["ready_s"] - self.marks["imports_s"],
            "compile_first_step_s": self.marks["first_step_s"] - self.marks["ready_s"],
            "steady_s": seconds,
            "tokens_per_s": tokens / seconds,
            # CPU used by other processes and stolen by the hypervisor while we were timed.
            "other_cpu_pct": max(busy - own, 0.0) / capacity,
            "steal_pct": steal / capacity,
            "losses": losses,
        }
