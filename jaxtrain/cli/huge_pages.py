"""`jaxtrain train` and `jaxtrain eval` run with glibc's transparent-huge-page tunable.

XLA:CPU takes each step's temporaries from the heap again at every step, 4 KiB page faults
each time. `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc 2.35+) has malloc back its memory
with 2 MiB transparent huge pages: CPU train steps 11-20% faster, the demo 1.3x
(bench/allocator.py). glibc reads the tunable only when a process starts, so these commands,
when it is missing, restart themselves once with it added, before anything heavy is imported
(~0.15 s). A GLIBC_TUNABLES that names the tunable already is kept as it is:
`glibc.malloc.hugetlb=0` turns it off. `jaxtrain serve` does not set it: with it, the server's
tokens/s was the same and its first token 15-25% later (bench/serve_vllm.py, bench/RESULTS.md
session 39).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
STEP_COMMANDS = ("train", "eval")  # the commands whose time is train and evaluation steps
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"  # "always [madvise] never"


def environment_with_huge_pages(
    environ: Mapping[str, str],
    system: str = sys.platform,
    glibc: tuple[int, int] | None = None,
    thp_mode: str | None = None,
) -> dict[str, str] | None:
    """`environ` with the tunable added to GLIBC_TUNABLES, or None where it would change
    nothing: not Linux with glibc 2.35+ (`glibc`: this process's by default), huge pages off
    in the kernel (`thp_mode`: THP_MODE's text by default), or the tunable named already (the
    user's value wins)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if system != "linux" or TUNABLE in tunables:
        return None
    glibc = _glibc_version() if glibc is None else glibc
    thp_mode = _thp_mode() if thp_mode is None else thp_mode
    if glibc < (2, 35) or not thp_mode or "[never]" in thp_mode:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, f"{TUNABLE}=1")))}


def _glibc_version() -> tuple[int, int]:
    """(0, 0) when the C library is not glibc (musl) or says no version."""
    library, version = platform.libc_ver()
    try:
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if library == "glibc" else (0, 0)
    except ValueError:
        return (0, 0)


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode line ("" without them)."""
    try:
        with open(THP_MODE) as mode:
            return mode.read()
    except OSError:
        return ""


def restart_with_huge_pages(command: str) -> None:
    """Replace this process by the same command line with the tunable set (same pid, same
    arguments and interpreter options), when `command` is one of STEP_COMMANDS,
    `environment_with_huge_pages` says it helps and the program is the command itself
    (`jaxtrain ...` or `python -m jaxtrain.cli ...`), not a script of the user's that calls
    `main()`: running that again would repeat its work."""
    if command not in STEP_COMMANDS:
        return
    program = sys.argv[0] if sys.argv else ""
    ours = os.path.basename(program) == "jaxtrain" or program.endswith(
        os.path.join("jaxtrain", "cli", "__main__.py")
    )
    environ = environment_with_huge_pages(os.environ)
    if ours and environ is not None and sys.executable:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
