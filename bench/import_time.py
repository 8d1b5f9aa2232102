"""What a process pays to import jaxtrain before it does anything: every CLI command, every
worker and every test process pays it. Fresh interpreters, `python -X importtime`, the
median of the rounds per module; the modules whose own import (not their imports') costs most.

    python bench/import_time.py --module jaxtrain.trainers --rounds 5 --top 12

Found with it (2026-12-02): ml_dtypes 0.7.0 spent 1.3 s of CPU in its own import (its ufunc
loops register in quadratic time), in every process that imports jax; pyproject.toml now
excludes that release.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)")


def one_import(python: str, module: str) -> tuple[float, dict[str, float]]:
    """Wall seconds of a fresh process importing `module`, and each module's own seconds."""
    started = time.perf_counter()
    done = subprocess.run(
        [python, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - started
    own = {}
    for match in LINE.finditer(done.stderr):
        own[match.group(4)] = own.get(match.group(4), 0.0) + int(match.group(1)) / 1e6
    return wall, own


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", default="jaxtrain.trainers")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()

    walls, owns = [], []
    for _ in range(args.rounds):
        wall, own = one_import(args.python, args.module)
        walls.append(wall)
        owns.append(own)
    print(f"import {args.module}: {len(walls)} fresh processes, load {os.getloadavg()[0]:.2f}")
    print(
        f"  wall median {statistics.median(walls):.2f} s "
        f"(min {min(walls):.2f}, max {max(walls):.2f})"
    )
    names = set().union(*owns)
    median_own = {n: statistics.median(o.get(n, 0.0) for o in owns) for n in names}
    top = sorted(median_own.items(), key=lambda item: -item[1])[: args.top]
    print("  its own import, median seconds:")
    for name, seconds in top:
        print(f"    {seconds:6.3f}  {name}")


if __name__ == "__main__":
    main()
