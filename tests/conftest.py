import gc
import os
import sys

import psutil
import pytest
from worker_memory import KEEP_PROGRAMS_BELOW_BYTES, release_freed_heap

from jaxtrain.cache import MAX_CACHE_BYTES  # imports no jax: the settings below still apply
from jaxtrain.cli.collector import collect_less_often

# Tests share one tokenizer cache per session, never the user's ~/.cache.
os.environ.setdefault("JAXTRAIN_CACHE", os.path.join(os.path.dirname(__file__), ".cache"))
# And one XLA program cache for every process a test starts, from its first compile (not only
# from a Trainer's), set before anything imports jax. The size cap (jaxtrain's own) turns on
# JAX's file lock, which keeps a process from reading an entry another is still writing.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.environ["JAXTRAIN_CACHE"], "xla")
)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(MAX_CACHE_BYTES))
# Programs kept from 0.2 s of compile (JAX's default is 1 s): under the flags below a small
# train or engine step compiles in well under a second, and another test or process that
# compiles it again (shared fixtures, the CLI's tiny runs) reads it back. Eager ops (~50 ms)
# stay out: kept too, each was written under the lock (session 20: 2,907 s against 2,785).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# Compiles are most of the suite's time, and on XLA:CPU every eager op of a new shape is a
# program of its own. LLVM level 0 with XLA:CPU's legacy emitters compiles eager ops, a model
# build and a train step in 0.4-0.5x level 1's time, for steps ~4x slower (bench/RESULTS.md,
# "XLA:CPU flags against the suite's time"; the docs' test sets them per block, and a program
# that runs many times may compile at level 1 through jax.jit's compiler_options, as
# tool_chat_fixtures.tool_caller does). A user's XLA_FLAGS level wins over jaxtrain's CPU
# default (runtime/compiler.py), so the Trainer's steps compile this way too. Worker
# processes add their device count to these.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{TEST_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()

# Every Python process a test starts collects garbage as jaxtrain's commands do
# (subprocess_site/sitecustomize.py); a test that sets its own PYTHONPATH leaves this out.
SUBPROCESS_SITE = os.path.join(os.path.dirname(__file__), "subprocess_site")
if SUBPROCESS_SITE not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (SUBPROCESS_SITE, os.environ.get("PYTHONPATH")) if p
    )

# The CLI's huge pages off in the processes the tests start (jaxtrain/cli/huge_pages.py keeps a
# GLIBC_TUNABLES that names the tunable). They make a long run's steps 11-20% faster, but a
# run of a few steps, as every run of the suite is, pays for zeroing 2 MiB pages it barely
# uses: a 2-step `jaxtrain train` took 1.2 s and 1.7 CPU-s more with them (6 interleaved
# pairs, bench/RESULTS.md 2026-12-04 session 58). tests/test_cli.py runs the commands without
# the variable, where the restart that adds it is tested.
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")

# The file that runs longest (every docs block, 10-20 minutes) starts first: started last, it
# alone kept one worker busy after the other had finished (make test: --no-loadscope-reorder).
LONGEST_FIRST = ("tests/test_docs.py",)


def pytest_collection_finish(session):
    """What the test modules imported (jax, flax, transformers, torch: millions of objects)
    lives all session: frozen, Python's garbage collector stops walking it at every full
    collection (below). And its young collections run every 20,000 allocations instead of
    700: tracing a program allocates millions of objects, and those collections were 5% of a
    worker's CPU samples (`perf`, tests/trainers/test_grpo.py and
    tests/models/test_blockwise_attention.py), 1.8% with these thresholds (the commands'
    own, jaxtrain/cli/collector.py)."""
    gc.collect()
    gc.freeze()
    collect_less_often()


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_once_a_worker_is_large():
    """A worker runs a hundred modules: its memory grew to 6 GiB with every compiled program
    kept, and two such workers beside a test's own processes can exhaust a 24 GiB machine.
    Dropped after every module, though, the eager ops (a program each on XLA:CPU) compiled
    again in the next: tests/models and tests/hf in two workers compiled 3,454 programs in
    373 s of test time, against 3,218 in 360 s when they went only once a worker passed 3 GiB.
    Past the mark, though, the freed heap stayed resident and every later module dropped them
    again: a whole run compiled 14,551 programs, 12,776 with the heap handed back
    (bench/RESULTS.md, session 64; the mark: tests/worker_memory.py). A later module that
    needs a large program loads it from the disk cache above."""
    yield
    gc.collect()  # a module's models and arrays first
    resident = psutil.Process().memory_info().rss
    if "jax" in sys.modules and resident > KEEP_PROGRAMS_BELOW_BYTES:
        gc.unfreeze()  # what was kept may be garbage now
        sys.modules["jax"].clear_caches()
        gc.collect()
        # Without this the worker stayed above the mark, and every later module dropped its
        # programs again (tests/worker_memory.py).
        release_freed_heap()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONGEST_FIRST)
