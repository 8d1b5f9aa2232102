"""Run by every Python process the tests start, before its own code: tests/conftest.py puts
this directory on PYTHONPATH, and Python's `site` imports `sitecustomize` at start-up.

It sets the garbage collector's thresholds of jaxtrain's commands (jaxtrain/cli/collector.py;
tests/test_cli_collector.py checks they are the same). The commands and the tests' workers set
them themselves, but the scripts the tests start (tests/parallel's workers, Ray's actors, the
accelerator campaign's stages) ran at Python's (700, 10, 10): a young collection every 700
allocations while they trace and lower their programs. With these, tests/parallel took 5% less
CPU (bench/RESULTS.md, session 66)."""

import gc

gc.set_threshold(20_000, 50, 1_000)
