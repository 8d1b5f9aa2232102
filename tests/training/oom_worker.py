"""`jaxtrain train ...` in a process that may allocate only LIMIT_MIB MiB more once step
AFTER_STEP is done, for the out-of-memory test (test_profile_and_oom.py).

`python oom_worker.py AFTER_STEP LIMIT_MIB train ARGS...` runs the command line's own
`main` with one callback added to the run. How the step runs out of memory on a CPU:
XLA:CPU allocates an executable's temporaries as one block with malloc, and RLIMIT_DATA
(Linux counts private anonymous mappings in it) makes malloc refuse a block past the limit,
which XLA reports as RESOURCE_EXHAUSTED, the status a GPU's allocator returns. The limit is
set after a step has run, above what the process holds then: start-up, the compile and the
first steps are untouched, and the next step's temporaries, larger than LIMIT_MIB, cannot be
had. The child's glibc keeps one malloc arena (MALLOC_ARENA_MAX, set by the test) so that
threads do not reserve address space of their own.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from pathlib import Path

import jax

from jaxtrain.cli import commands, main


def data_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return 1024 * int(re.search(r"^VmData:\s+(\d+) kB", status, re.MULTILINE).group(1))


class LimitAfter:
    def __init__(self, step: int, mib: int):
        self.step, self.mib = step, mib

    def on_step_start(self, trainer, state, step) -> None:
        if step == self.step:
            # The steps so far have run and their temporaries are returned (XLA frees them
            # just after the outputs are ready: wait until the figure stands still).
            jax.block_until_ready(state)
            used, previous = data_bytes(), -1
            while used != previous:
                time.sleep(0.05)
                used, previous = data_bytes(), used
            limit = used + self.mib * 2**20
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))
            print(f"limited after step {step}", flush=True)


if __name__ == "__main__":
    after, mib = int(sys.argv[1]), int(sys.argv[2])
    train = commands.cmd_train
    # The command line's own dispatch and error handling, with the limit added to the run.
    commands.cmd_train = lambda tokens, **options: train(
        tokens, callbacks=[LimitAfter(after, mib)], **options
    )
    sys.exit(main(sys.argv[3:]))
