"""Peak FLOP/s per device kind: the one table MFU divides by.

Accelerator peaks are the vendors' dense (no sparsity) bf16 matrix-unit numbers, per chip
(a TPU chip, one GPU). That is the usual MFU convention, so an fp32 run's MFU is low on
purpose: it is measured against what the hardware could do in bf16.

CPUs have no such number worth trusting: the peak is measured once per machine as the best
of several short bursts of 2048^2 fp32 matmuls (XLA:CPU is fastest in fp32 on most machines;
the best burst sees past another process's load), stored in `$JAXTRAIN_CACHE/cpu_peak.json`
and shared by the process's CPU devices; `JAXTRAIN_CPU_PEAK_TFLOPS` sets it by hand. A run
that achieves more than the stored peak proves it stale (measured under load): the monitor
then probes again and raises the stored peak to at least what the run achieved
(`remeasure_cpu_peak`). A device kind missing from the table gets peak None: TFLOP/s are
reported, MFU is not, rather than a made-up number.

Every peak says where it came from (`PeakFlops.source`, in run_info.json): "table",
"measured" (probed by this process), "cached" (read from cpu_peak.json), "remeasured" (raised
during the run) or "environment" (JAXTRAIN_CPU_PEAK_TFLOPS).
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxtrain.cache import cache_root

TERA = 1e12

# (substrings of the lower-cased device_kind, name, dense bf16 FLOP/s per chip). First match
# wins, so a more specific entry (H100 PCIe, v5 lite) stands before its family.
PEAK_FLOPS: tuple[tuple[tuple[str, ...], str, float], ...] = (
    (("h100 pcie",), "H100 PCIe", 756 * TERA),
    (("h100 nvl",), "H100 NVL", 835 * TERA),
    (("h100",), "H100 SXM", 989 * TERA),
    (("h200",), "H200", 989 * TERA),
    (("a100",), "A100", 312 * TERA),
    (("tpu v4",), "TPU v4", 275 * TERA),
    (("tpu v5 lite", "tpu v5e", "tpu v5litepod"), "TPU v5e", 197 * TERA),
    (("tpu v5p", "tpu v5"), "TPU v5p", 459 * TERA),
    (("tpu v6 lite", "tpu v6e", "tpu v6"), "TPU v6e", 918 * TERA),
)


def table_peak(device_kind: str) -> tuple[str, float] | None:
    """(name, peak FLOP/s) of a device kind from the table, or None when it is not listed."""
    kind = device_kind.lower()
    for patterns, name, peak in PEAK_FLOPS:
        if any(p in kind for p in patterns):
            return name, peak
    return None


CPU_PEAK_FILE = "cpu_peak.json"


@dataclass(frozen=True)
class PeakFlops:
    """A peak FLOP/s (of the machine's CPU, or of one device) and where it came from."""

    flops: float | None
    source: str  # table | measured | cached | remeasured | environment | unknown
    measured_at: float | None = None  # Unix time of the probe behind a CPU peak

    def to_json(self) -> dict[str, Any]:
        when = self.measured_at
        stamp = datetime.fromtimestamp(when, timezone.utc).isoformat() if when else None
        return {"source": self.source, "flops": self.flops, "measured_at": stamp}


def machine_signature() -> str:
    """What the CPU peak depends on: host, CPU model, usable cores, jax version."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.node()}|{model}|{cores} cores|jax {jax.__version__}"


def probe_cpu_peak(
    size: int = 2048, seconds: float = 2.0, min_repeats: int = 1, probes: int = 4
) -> float:
    """FLOP/s of the fastest fp32 size x size matmul on the first CPU device, over `probes`
    short bursts (each about seconds / probes long, at least `min_repeats` matmuls) with a
    pause between them: load from another process that covers one burst does not cover all,
    and only the best one counts."""
    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()  # compile
    best = float("inf")
    for burst in range(probes):
        if burst:
            time.sleep(min(0.2, seconds / probes))  # let a short spike of load pass
        repeats, began = 0, time.perf_counter()
        while repeats < min_repeats or time.perf_counter() - began < seconds / probes:
            start = time.perf_counter()
            matmul(a).block_until_ready()
            best = min(best, time.perf_counter() - start)
            repeats += 1
    return 2.0 * size**3 / best


def _peak_file(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir if cache_dir is not None else cache_root()) / CPU_PEAK_FILE


def _store(path: Path, peak: float, when: float, probe: dict[str, Any]) -> None:
    record = {"machine": machine_signature(), "peak_flops": peak, "measured": when, **probe}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(path)  # atomic: a concurrent run reads the old file or the new one
    except OSError:
        pass  # a read-only cache still gives this process its measured peak


def cpu_peak(cache_dir: str | Path | None = None, **probe: Any) -> PeakFlops:
    """The CPU peak of this machine: `$JAXTRAIN_CPU_PEAK_TFLOPS` if set, else the value in
    `<cache_dir>/cpu_peak.json` for this machine's signature, else probed once and stored there.

    One number per machine makes the MFU of identical runs comparable (a per-process probe
    moved with the load of the moment). Delete the file to measure again.
    """
    override = os.environ.get("JAXTRAIN_CPU_PEAK_TFLOPS")
    if override:
        return PeakFlops(float(override) * TERA, "environment")
    path = _peak_file(cache_dir)
    try:
        stored = json.loads(path.read_text())
        if stored.get("machine") == machine_signature() and stored.get("peak_flops", 0) > 0:
            return PeakFlops(float(stored["peak_flops"]), "cached", stored.get("measured"))
    except (OSError, ValueError, AttributeError):
        pass  # absent, unreadable or from another machine: measure again
    when = time.time()
    peak = probe_cpu_peak(**probe)
    _store(path, peak, when, probe)
    return PeakFlops(peak, "measured", when)


def cached_cpu_peak(cache_dir: str | Path | None = None, **probe: Any) -> float:
    """`cpu_peak(...)`'s FLOP/s."""
    return float(cpu_peak(cache_dir, **probe).flops or 0.0)


def remeasure_cpu_peak(
    achieved: float, cache_dir: str | Path | None = None, **probe: Any
) -> PeakFlops:
    """A run achieved `achieved` FLOP/s (whole machine), more than the stored peak: the
    stored number may have been measured under load. Probe again and store the probe (never
    the run's own figure: a FLOPs count or a window's timing can be wrong, and a stored
    peak outlives the run); this process uses it from now on. A run that still beats it
    gets its MFU clamped at 100%."""
    del achieved  # why the probe runs, not what it finds
    when = time.time()
    peak = probe_cpu_peak(**probe)
    _store(_peak_file(cache_dir), peak, when, probe)
    result = PeakFlops(peak, "remeasured", when)
    with _process_lock:
        _process_peak[:] = [result]
    return result


# This process's CPU peak: read (or probed) once, replaced by `remeasure_cpu_peak`.
_process_peak: list[PeakFlops] = []
_process_lock = threading.Lock()


def measured_cpu_peak_info() -> PeakFlops:
    """This machine's CPU peak for this process (see `cpu_peak`), read once."""
    with _process_lock:
        if not _process_peak:
            _process_peak.append(cpu_peak())
        return _process_peak[0]


def measured_cpu_peak() -> float:
    """This machine's CPU peak FLOP/s (cached on disk, see `cpu_peak`)."""
    return float(measured_cpu_peak_info().flops or 0.0)


def forget_cpu_peak() -> None:
    """Make the next `measured_cpu_peak` read the cache (or probe) again."""
    with _process_lock:
        _process_peak.clear()


def cpu_shares() -> int:
    """XLA:CPU devices of one process share its cores: each gets an equal share."""
    return max(len(jax.local_devices(backend="cpu")), 1)


def device_peak(device: jax.Device | None = None) -> tuple[str, PeakFlops]:
    """(description, peak FLOP/s per device with its source) for `device` (default: the
    first); the peak's flops are None for a device kind not in the table."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        shares = cpu_shares()
        share = f", 1/{shares} each" if shares > 1 else ""
        machine = measured_cpu_peak_info()
        per_device = PeakFlops((machine.flops or 0.0) / shares, machine.source, machine.measured_at)
        return f"CPU (peak measured{share})", per_device
    found = table_peak(device.device_kind)
    if found is None:
        return f"{device.device_kind} (not in the peak table: no MFU)", PeakFlops(None, "unknown")
    return found[0], PeakFlops(found[1], "table")


def device_peak_flops(device: jax.Device | None = None) -> tuple[str, float | None]:
    """(description, peak FLOP/s per device or None) for `device` (default: the first)."""
    description, peak = device_peak(device)
    return description, peak.flops
