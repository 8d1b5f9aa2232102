"""Where a profiled step's device time goes: a jax.profiler Perfetto trace summed by kernel.

    python bench/trace_summary.py TRACE_DIR [--top 15]

Reads the `perfetto_trace.json.gz` that `jax.profiler.trace(..., create_perfetto_trace=True)`
writes, keeps the complete events ("ph": "X") of the device processes (named "/device:GPU:N"
and the like; on a CPU run there are none and the host's XLA threads are summed instead), and
sums their durations per kernel name and per category (matmul, attention, collective, copy,
other fusions). Numpy-free, jax-free: it reads a file.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path

CATEGORIES = (
    ("attention", re.compile(r"fmha|flash|cudnn|attn|attention", re.I)),
    ("matmul", re.compile(r"gemm|cublas|cutlass|xmma|nvjet|matmul|dot", re.I)),
    ("collective", re.compile(r"nccl|all-reduce|all-gather|reduce-scatter|all_reduce", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def find_trace(trace_dir: Path) -> Path:
    found = sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"{trace_dir}: no perfetto_trace.json.gz under it")
    return found[-1]


def summarize(trace_dir: Path, top: int = 15) -> dict:
    """{"source", "busy_us", "span_us", "categories": {label: us}, "kernels": [[name, us, n]]}."""
    data = json.loads(gzip.decompress(find_trace(trace_dir).read_bytes()))
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {pid for pid, name in processes.items() if name.startswith("/device:")}
    threads = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    if device:
        keep = [e for e in events if e.get("ph") == "X" and e["pid"] in device]
        source = "device"
    else:  # XLA:CPU runs its kernels on the host's XLA threads
        keep = [
            e
            for e in events
            if e.get("ph") == "X"
            and "XLA" in threads.get((e["pid"], e.get("tid")), "")
            # The executor around the kernels, and its thread pool's waits (as many as the
            # scheduling of the moment makes: under load a step waited 3 times, not 2 or 4).
            and not e["name"].startswith(("ThunkExecutor", "SlinkyThreadPool"))
        ]
        source = "host XLA threads"
    per_kernel: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e in keep:
        per_kernel[e["name"]] += float(e.get("dur", 0.0))
        calls[e["name"]] += 1
    per_category: collections.Counter = collections.Counter()
    for name, us in per_kernel.items():
        per_category[category(name)] += us
    starts = [float(e["ts"]) for e in keep]
    ends = [float(e["ts"]) + float(e.get("dur", 0.0)) for e in keep]
    return {
        "source": source,
        "events": len(keep),
        "busy_us": sum(per_kernel.values()),
        "span_us": (max(ends) - min(starts)) if keep else 0.0,
        "categories": dict(per_category.most_common()),
        "kernels": [[n, us, calls[n]] for n, us in per_kernel.most_common(top)],
    }


def lines(summary: dict) -> list[str]:
    busy = summary["busy_us"] or 1.0
    out = [
        f"{summary['events']} kernels on the {summary['source']}: busy "
        f"{summary['busy_us'] / 1e3:.1f} ms of a {summary['span_us'] / 1e3:.1f} ms span"
    ]
    out += [
        f"  {label:<11} {us / 1e3:9.1f} ms  {100 * us / busy:5.1f}%"
        for label, us in summary["categories"].items()
    ]
    out += [
        f"  {us / 1e3:9.1f} ms {count:6d}x  {name[:90]}" for name, us, count in summary["kernels"]
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", type=Path)
    parser.add_argument("--top", type=int, default=15)
    opts = parser.parse_args(argv)
    print("\n".join(lines(summarize(opts.trace_dir, opts.top))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
