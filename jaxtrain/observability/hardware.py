"""Peak FLOP/s per device kind: the one table MFU divides by.

Accelerator peaks are the vendors' dense (no sparsity) bf16 matrix-unit numbers, per chip
(a TPU chip, one GPU). That is the usual MFU convention, so an fp32 run's MFU is low on
purpose: it is measured against what the hardware could do in bf16.

CPUs have no such number worth trusting: the peak is measured once per process with a
fp32 matmul (XLA:CPU is fastest in fp32 on most machines) and shared by the process's CPU
devices. A device kind missing from the table gets peak None: TFLOP/s are reported, MFU
is not, rather than a made-up number.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp

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


@functools.cache
def measured_cpu_peak(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` fp32 size x size matmuls on the first CPU device
    (about 0.2 s once per process)."""
    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((size, size), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def device_peak_flops(device: jax.Device | None = None) -> tuple[str, float | None]:
    """(description, peak FLOP/s per device or None) for `device` (default: the first)."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        # XLA:CPU devices of one process share its cores: each gets an equal share.
        shares = max(len(jax.local_devices(backend="cpu")), 1)
        share = f", 1/{shares} each" if shares > 1 else ""
        return f"CPU (peak measured{share})", measured_cpu_peak() / shares
    found = table_peak(device.device_kind)
    if found is None:
        return f"{device.device_kind} (not in the peak table: no MFU)", None
    return found
