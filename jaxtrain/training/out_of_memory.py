"""A step that runs out of device memory ends in one line (errors.OutOfMemoryError).

XLA reports it as RESOURCE_EXHAUSTED: a GPU's allocator at the step's launch, XLA:TPU at
compile time (its buffer assignment does not fit the HBM), XLA:CPU when malloc refuses the
step's temporaries (one block of the executable's `temporaries` bytes: a process limit such
as RLIMIT_DATA, or a request larger than the machine's memory). XLA:CPU takes the next
step's block while one runs (the loop dispatches ahead): measured with such a limit, a step
whose peak fits stopped at its second step, and ran when each step was waited for. The line gives what the
compiled step needs per device (its memory analysis, what `jaxtrain plan` predicts), about
how much was free for it, and where the device-memory profile taken at the failure lies.
`jaxtrain train` then adds the settings found to fit (planning/fit.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import jax

from jaxtrain.errors import OutOfMemoryError


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is XLA's out-of-memory status (not a Python MemoryError of the host)."""
    return isinstance(err, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(err)


def out_of_memory_error(
    err: BaseException,
    step: int,
    step_memory: dict[str, float] | None,
    output_dir: str | Path,
    process_index: int,
) -> OutOfMemoryError:
    """The one-line error for XLA's `err` at `step`; writes the device memory profile."""
    cause = " ".join(str(err).split())
    cause = cause if len(cause) <= 200 else cause[:197] + "..."
    profile = Path(output_dir).absolute() / f"memory_oom_process_{process_index}.prof"
    try:
        profile.parent.mkdir(parents=True, exist_ok=True)
        jax.profiler.save_device_memory_profile(profile)
    except Exception as failure:  # the error the run ends on is the memory one; say this too
        cause += f"; the device memory profile could not be written ({failure})"
        profile = None
    needed = step_memory["peak"] if step_memory else None
    free = free_for_step(step_memory) if step_memory else None
    return OutOfMemoryError(
        step,
        cause,
        needed_bytes=needed,
        temporaries_bytes=step_memory["temporaries"] if step_memory else None,
        free_bytes=free,
        profile=str(profile) if profile else None,
    )


def free_for_step(step_memory: dict[str, float]) -> float | None:
    """About how many bytes per device the step could have had: what is free now plus its
    own arguments (the state and batch, already resident and counted in its peak)."""
    devices = jax.local_devices()
    if devices[0].platform != "cpu":
        stats = [d.memory_stats() or {} for d in devices]
        if not all("bytes_limit" in s for s in stats):
            return None
        free = min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
        return float(free + step_memory["arguments"])
    # XLA:CPU's devices share the process's memory: its limit, else the machine's.
    free = host_headroom()
    if free is None:
        return None
    return float(free / len(devices) + step_memory["arguments"])


def host_headroom() -> float | None:
    """Bytes this process may still allocate: under RLIMIT_DATA or RLIMIT_AS (what they
    count, /proc/self/status), else the machine's available memory."""
    import resource

    status = Path("/proc/self/status")
    text = status.read_text() if status.is_file() else ""
    headroom = []
    for limit, key in ((resource.RLIMIT_DATA, "VmData"), (resource.RLIMIT_AS, "VmSize")):
        soft, _ = resource.getrlimit(limit)
        used = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
        if soft != resource.RLIM_INFINITY and used:
            headroom.append(soft - 1024 * int(used.group(1)))
    try:
        import psutil

        headroom.append(psutil.virtual_memory().available)
    except ImportError:
        pass
    return float(max(0, min(headroom))) if headroom else None
