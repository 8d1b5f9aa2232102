"""Python's garbage collector in a process that is a jaxtrain command's own.

Only there: `jaxtrain ...` from a shell calls these, `main([...])` called from a program (a test,
a Tune trial's actor, a notebook) leaves that program's collector as it was.

- Thresholds. Tracing and lowering a program allocate millions of short-lived objects, on top
  of the million or so that jax, flax, transformers and datasets leave after their imports. At
  Python's defaults (700, 10, 10) a young collection ran every 700 net allocations and full
  ones walked that heap again and again. These thresholds took 9% off the CPU of a tiny
  8-step `jaxtrain train` and 4% off the demo's first step from an empty compilation cache
  (`bench/collector.py`, bench/RESULTS.md session 59). The tests' workers use them too.
- Freezing. Once a command has built its model and data, what lives then lives until the end.
"""

from __future__ import annotations

import gc

# A young collection every 20,000 net allocations, a middle one every 50 of those, a full one
# every 1,000 middle ones (and Python waits until the old generation has grown by a quarter).
THRESHOLDS = (20_000, 50, 1_000)


def collect_less_often() -> None:
    """Set this process's collection thresholds to THRESHOLDS (at the command's start)."""
    gc.set_threshold(*THRESHOLDS)


def freeze_the_heap() -> None:
    """Collect once, then move every live object out of the collector's walk. Its libraries,
    model and data live until the process ends, and each full collection walked them all
    again (0.3-0.4 s of a one-step `jaxtrain train`; on a long run, a pause between steps that
    grows with the heap). Garbage made later is collected as before, but a frozen object never
    is: in a caller's process the objects of an earlier run would stay."""
    gc.collect()
    gc.freeze()
