"""Where the test suite's time goes: pytest with a plugin that records, for every test, its
wall time, its CPU seconds (its worker's, and those of the processes it started and waited
for), and the seconds JAX spent in its worker tracing, lowering and compiling (JAX's own
monitoring events), with the worker that ran it and when it started; then a summary by file
and each worker's span.

    python bench/suite_profile.py --out /tmp/profile.jsonl -- -n 2 --dist loadfile tests/trainers

Everything after `--` goes to pytest. Each worker appends its tests to the JSONL file. The
suite is CPU-bound when the CPU seconds of every test, summed, fill the cores for the whole
run; a test whose wall time is far above its CPU seconds waits (timeouts, sleeps, processes it
did not start itself, such as Ray's, or the other worker holding the cores). Compiles in the
processes a test starts count in its child CPU only. Programs that compile in less than the
persistent cache's threshold (`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, 0.2 s in the
tests) are counted apart: no disk cache keeps them, so each process pays them again. Most are
eager ops: every jax op run outside `jit` on a new shape is a program of its own on XLA:CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile",
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
}
OUT_VARIABLE = "JAXTRAIN_SUITE_PROFILE"  # the workers find the output file here
CACHE_THRESHOLD_VARIABLE = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
JAX_CACHE_THRESHOLD = 1.0  # seconds, where the variable is unset


def cpu_seconds() -> tuple[float, float]:
    """(this process's, its waited-for children's) user + system CPU seconds."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


class CompileProfile:
    """A pytest plugin: one JSON line per test."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.programs = 0
        self.small_programs = 0
        self.small_seconds = JAX_CACHE_THRESHOLD
        self.listening = False

    def _listen(self, event: str, duration: float, **_) -> None:
        kind = EVENTS.get(event)
        if kind:
            self.seconds[kind] += duration
        if kind == "compile":
            self.programs += 1
            if duration < self.small_seconds:
                self.small_programs += 1
                self.seconds["small_compile"] += duration

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if not self.listening:
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(self._listen)
            self.listening = True
            # Read at the first test: the tests' conftest sets it after this plugin loads.
            self.small_seconds = float(
                os.environ.get(CACHE_THRESHOLD_VARIABLE, JAX_CACHE_THRESHOLD)
            )
        self.seconds.clear()
        self.programs = self.small_programs = 0
        started, (own, children) = time.perf_counter(), cpu_seconds()
        yield
        own_after, children_after = cpu_seconds()
        row = {"test": item.nodeid, "wall": time.perf_counter() - started, **self.seconds}
        # Where and when: the summary's per-worker spans show a worker idle at the end.
        # From xdist's own worker input, not PYTEST_XDIST_WORKER: a pytest that a worker's
        # test starts inherits that variable.
        row["worker"] = getattr(item.config, "workerinput", {}).get("workerid", "main")
        row["start"] = time.time() - row["wall"]
        row["cpu"], row["child_cpu"] = own_after - own, children_after - children
        row["programs"], row["small_programs"] = self.programs, self.small_programs
        with open(os.environ[OUT_VARIABLE], "a") as out:
            out.write(json.dumps(row) + "\n")


def pytest_configure(config) -> None:
    """Registers the plugin in pytest and in every xdist worker (`-p suite_profile`)."""
    if OUT_VARIABLE in os.environ and not config.pluginmanager.has_plugin("compile_profile"):
        config.pluginmanager.register(CompileProfile(), "compile_profile")


# The summary's columns: a header and the row keys summed into each.
COLUMNS = {
    "wall s": ("wall",),
    "cpu s": ("cpu",),
    "child cpu s": ("child_cpu",),
    "compile s": ("compile",),
    "trace+lower s": ("trace", "lower"),
    "programs": ("programs",),
    "small": ("small_programs",),
    "small s": ("small_compile",),
}
COUNTS = {"programs", "small"}  # printed as whole numbers
ROW_WIDTH = len(COLUMNS) + 1  # the columns, then the number of tests


def summary(rows: list[dict], top: int) -> list[str]:
    """Per file, every column summed, the files with the most wall time first; `small` counts
    the programs no disk cache keeps (the module docstring)."""
    files: dict[str, list[float]] = defaultdict(lambda: [0.0] * ROW_WIDTH)
    for row in rows:
        total = files[row["test"].split("::")[0]]
        for i, keys in enumerate(COLUMNS.values()):
            total[i] += sum(row.get(key, 0.0) for key in keys)
        total[-1] += 1
    widths = [max(len(header), 8) for header in COLUMNS]
    header = " ".join(f"{h:>{w}}" for h, w in zip(COLUMNS, widths, strict=True))
    lines = [f"{header} {'tests':>5}  file"]
    ranked = sorted(files.items(), key=lambda item: -item[1][0])
    for name, totals in [("all", _sum(files)), *ranked[:top]]:
        cells = " ".join(
            f"{v:>{w}.{0 if h in COUNTS else 1}f}"
            for v, w, h in zip(totals, widths, COLUMNS, strict=False)
        )
        lines.append(f"{cells} {totals[-1]:5.0f}  {name}")
    return lines + worker_spans(rows)


def worker_spans(rows: list[dict]) -> list[str]:
    """Each worker's first test start and last test end, in seconds from the run's first
    start: a worker that ends long before the others left its core idle."""
    if not rows:
        return []
    origin = min(r["start"] for r in rows)
    spans: dict[str, list[float]] = {}
    for r in rows:
        begin, end = r["start"] - origin, r["start"] + r["wall"] - origin
        span = spans.setdefault(r["worker"], [begin, end])
        span[0], span[1] = min(span[0], begin), max(span[1], end)
    return [
        "workers: " + ", ".join(f"{w} {b:.1f}-{e:.1f} s" for w, (b, e) in sorted(spans.items()))
    ]


def _sum(files: dict[str, list[float]]) -> list[float]:
    return [sum(values) for values in zip(*files.values())] if files else [0.0] * ROW_WIDTH


def split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """(this script's arguments, pytest's: everything after `--`)."""
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def run_pytest_with_plugin(plugin: str, pytest_args: list[str]) -> int:
    """pytest.main with the bench module `plugin` loaded in it and in every xdist worker."""
    here = str(Path(__file__).resolve().parent)  # the workers import the plugin by name
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    return int(pytest.main(["-p", plugin, *pytest_args]))


def main(argv: list[str] | None = None) -> int:
    ours, theirs = split_at_dashes(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="suite_profile.jsonl")
    parser.add_argument("--top", type=int, default=30, help="files in the summary")
    opts = parser.parse_args(ours)
    out = Path(opts.out).resolve()
    out.unlink(missing_ok=True)
    os.environ[OUT_VARIABLE] = str(out)
    code = run_pytest_with_plugin("suite_profile", theirs)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    print("\n".join(summary(rows, opts.top)))
    return code


if __name__ == "__main__":
    sys.exit(main())
