"""A pytest worker's memory: the mark past which it drops its programs, and handing freed heap
back to the system.

tests/conftest.py drops a worker's compiled programs once its resident memory passes
KEEP_PROGRAMS_BELOW_BYTES. glibc keeps the heap pages a process frees for its own later use,
so after the drop the resident size barely moved (3.2-3.35 GiB) and every later module dropped
its programs again: the eager ops they had compiled were compiled again in the next module.
`release_freed_heap` returns those pages, so the check reads what the worker really holds
(1.3-1.75 GiB after a drop).
"""

from __future__ import annotations

import ctypes

# A worker's resident memory past which its compiled programs are dropped. With the freed heap
# handed back, a whole run's two workers passed 3 GiB 8 times (3.6 GiB at the most at a
# module's end); a GiB more for each keeps the two and a test's processes far inside the build
# machines' 24 GiB.
KEEP_PROGRAMS_BELOW_BYTES = 4 << 30


def release_freed_heap() -> bool:
    """Return the heap's free pages to the system (glibc's malloc_trim); False where the C
    library has no such call (musl, macOS), which then keeps them as before."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the C library already loaded
    if trim is None:
        return False
    trim(0)
    return True
