"""Peak FLOP/s per device kind: the one table MFU divides by.

Accelerator peaks are the vendors' dense (no sparsity) bf16 matrix-unit numbers, per chip
(a TPU chip, one GPU). That is the usual MFU convention, so an fp32 run's MFU is low on
purpose: it is measured against what the hardware could do in bf16.

CPUs have no such number worth trusting: the peak is measured once per machine with
repeated 2048^2 fp32 matmuls for about 2 s (XLA:CPU is fastest in fp32 on most machines),
stored in `$JAXTRAIN_CACHE/cpu_peak.json` and shared by the process's CPU devices;
`JAXTRAIN_CPU_PEAK_TFLOPS` sets it by hand. A device kind missing from the table gets peak None: TFLOP/s are reported, MFU
is not, rather than a made-up number.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
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


def probe_cpu_peak(size: int = 2048, seconds: float = 2.0, min_repeats: int = 5) -> float:
    """FLOP/s of the fastest of repeated fp32 size x size matmuls on the first CPU device,
    repeated for at least `seconds` (a longer probe sees past short load spikes)."""
    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()  # compile
    best, repeats, began = float("inf"), 0, time.perf_counter()
    while repeats < min_repeats or time.perf_counter() - began < seconds:
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
        repeats += 1
    return 2.0 * size**3 / best


def cached_cpu_peak(cache_dir: str | Path | None = None, **probe: Any) -> float:
    """The CPU peak of this machine: `$JAXTRAIN_CPU_PEAK_TFLOPS` if set, else the value in
    `<cache_dir>/cpu_peak.json` for this machine's signature, else probed once and stored there.

    One number per machine makes the MFU of identical runs comparable (a per-process probe
    moved with the load of the moment). Delete the file to measure again.
    """
    override = os.environ.get("JAXTRAIN_CPU_PEAK_TFLOPS")
    if override:
        return float(override) * TERA
    path = Path(cache_dir if cache_dir is not None else cache_root()) / CPU_PEAK_FILE
    signature = machine_signature()
    try:
        stored = json.loads(path.read_text())
        if stored.get("machine") == signature and stored.get("peak_flops", 0) > 0:
            return float(stored["peak_flops"])
    except (OSError, ValueError, AttributeError):
        pass  # absent, unreadable or from another machine: measure again
    peak = probe_cpu_peak(**probe)
    record = {"machine": signature, "peak_flops": peak, "measured": time.time(), **probe}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        tmp.replace(path)  # atomic: a concurrent run reads the old file or the new one
    except OSError:
        pass  # a read-only cache still gives this process its measured peak
    return peak


@functools.cache
def measured_cpu_peak() -> float:
    """This machine's CPU peak FLOP/s (cached on disk, see `cached_cpu_peak`)."""
    return cached_cpu_peak()


def device_peak_flops(device: jax.Device | None = None) -> tuple[str, float | None]:
    """(description, peak FLOP/s per device or None) for `device` (default: the first)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        # XLA:CPU devices of one process share its cores: each gets an equal share.
        shares = max(len(jax.local_devices(backend="cpu")), 1)
        share = f", 1/{shares} each" if shares > 1 else ""
        return f"CPU (peak measured once per machine{share})", measured_cpu_peak() / shares
    found = table_peak(device.device_kind)
    if found is None:
        return f"{device.device_kind} (not in the peak table: no MFU)", None
    return found
