"""The host allocator under XLA:CPU: glibc malloc (its defaults and settings) against jemalloc.

    python bench/allocator.py [--sizes S2] [--repeats 3] [--jemalloc PATH] [--json P]

XLA:CPU allocates every step's temporaries (activations, gradients) from the host heap and
frees them at the step's end, and each step faults its working set in again, 4 KiB at a time
(~1.2 GB a step on the 37.8M model: 4.1M minor faults in a 12-step run). Each setting runs overhead.py's `trainer`
worker (the README's Python path) in its own process, interleaved per repeat, and reports
tokens/s, the first step, peak RSS and the minor page faults of the whole run. jemalloc is
preloaded (LD_PRELOAD) from PATH; Ray's wheel ships one (ray/core/libjemalloc.so), which is the
default when `ray` is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import DEFAULT_STEPS  # noqa: E402 - bench/ is not a package
from overhead import run_worker  # noqa: E402

WARMUP = 4


def ray_jemalloc() -> str | None:
    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "core" / "libjemalloc.so"
    return str(path) if path.exists() else None


def settings(jemalloc: str | None) -> dict[str, dict[str, str]]:
    out = {
        "glibc": {},
        # malloc'd memory advised as transparent huge pages (glibc >= 2.35, THP "madvise")
        "glibc hugetlb=1": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
        # keep freed memory in the heap instead of returning it to the kernel
        "glibc top pad 1 GiB": {
            "MALLOC_TOP_PAD_": str(2**30),
            "MALLOC_TRIM_THRESHOLD_": str(2**31),
            "MALLOC_MMAP_THRESHOLD_": str(2**25),
        },
    }
    if jemalloc:
        out["jemalloc"] = {"LD_PRELOAD": jemalloc}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="S2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--jemalloc", default=None, help="path of libjemalloc.so (default: Ray's)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    jemalloc = args.jemalloc or ray_jemalloc()
    print(f"command: python {' '.join(sys.argv)}; load {os.getloadavg()}; jemalloc {jemalloc}")
    results: dict = {}
    for size in args.sizes.split(","):
        steps = DEFAULT_STEPS[size]
        runs: dict[str, list[dict]] = {name: [] for name in settings(jemalloc)}
        for repeat in range(args.repeats):
            names = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
            for name in names:
                env = {**os.environ, **settings(jemalloc)[name]}
                r = run_worker("trainer", size, steps, WARMUP, env)
                runs[name].append(r)
                print(
                    f"  {size} {repeat} {name}: {r['tokens_per_s']:.0f} tok/s, first step "
                    f"{r['first_step_s']:.2f} s, RSS {r['peak_rss_mb']:.0f} MB, minor faults "
                    f"{r['minor_faults']:,}, other CPU {r['other_cpu_pct']:.1f}%",
                    flush=True,
                )
        print(f"\n{size}: median (min-max) of {args.repeats} runs, load {os.getloadavg()}")
        print("| allocator | tokens/s | first step s | peak RSS MB | minor faults |")
        print("|---|---|---|---|---|")
        for name, rs in runs.items():

            def cell(key: str, fmt: str, rs=rs) -> str:
                values = [r[key] for r in rs]
                return (
                    f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
                )

            print(
                f"| {name} | {cell('tokens_per_s', '.0f')} | {cell('first_step_s', '.2f')} | "
                f"{cell('peak_rss_mb', '.0f')} | {cell('minor_faults', ',.0f')} |"
            )
        results[size] = runs
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
