"""Where the test suite's time goes: pytest with a plugin that records, for every test, its
wall time and the seconds JAX spent in its worker tracing, lowering and compiling (JAX's own
monitoring events), then a summary by file.

    python bench/suite_profile.py --out /tmp/profile.jsonl -- -n 2 --dist loadfile tests/trainers

Everything after `--` goes to pytest. Each worker appends its tests to the JSONL file. Work in
the processes a test starts (the CLI, multi-process workers) counts in the test's wall time
only. Many programs per test with little compile time each are eager ops: every jax op run
outside `jit` on a new shape is a program of its own on XLA:CPU.
"""

from __future__ import annotations

import argparse
import json
import os
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


class CompileProfile:
    """A pytest plugin: one JSON line per test."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.programs = 0
        self.listening = False

    def _listen(self, event: str, duration: float, **_) -> None:
        kind = EVENTS.get(event)
        if kind:
            self.seconds[kind] += duration
            self.programs += kind == "compile"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if not self.listening:
            import jax.monitoring

            jax.monitoring.register_event_duration_secs_listener(self._listen)
            self.listening = True
        self.seconds.clear()
        self.programs = 0
        started = time.perf_counter()
        yield
        row = {"test": item.nodeid, "wall": time.perf_counter() - started, **self.seconds}
        row["programs"] = self.programs
        with open(os.environ[OUT_VARIABLE], "a") as out:
            out.write(json.dumps(row) + "\n")


def pytest_configure(config) -> None:
    """Registers the plugin in pytest and in every xdist worker (`-p suite_profile`)."""
    if OUT_VARIABLE in os.environ and not config.pluginmanager.has_plugin("compile_profile"):
        config.pluginmanager.register(CompileProfile(), "compile_profile")


def summary(rows: list[dict], top: int) -> list[str]:
    files: dict[str, list[float]] = defaultdict(lambda: [0.0] * 5)
    for row in rows:
        total = files[row["test"].split("::")[0]]
        total[0] += row["wall"]
        total[1] += row.get("compile", 0.0)
        total[2] += row.get("trace", 0.0) + row.get("lower", 0.0)
        total[3] += row["programs"]
        total[4] += 1
    lines = [
        f"{'wall s':>8} {'compile s':>9} {'trace+lower s':>13} {'programs':>8} {'tests':>5}  file"
    ]
    ranked = sorted(files.items(), key=lambda item: -item[1][0])
    for name, (wall, compile_s, traced, programs, tests) in [("all", _sum(files)), *ranked[:top]]:
        lines.append(
            f"{wall:8.1f} {compile_s:9.1f} {traced:13.1f} {programs:8.0f} {tests:5.0f}  {name}"
        )
    return lines


def _sum(files: dict[str, list[float]]) -> list[float]:
    return [sum(values) for values in zip(*files.values())] if files else [0.0] * 5


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, theirs = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="suite_profile.jsonl")
    parser.add_argument("--top", type=int, default=30, help="files in the summary")
    opts = parser.parse_args(ours)
    out = Path(opts.out).resolve()
    out.unlink(missing_ok=True)
    os.environ[OUT_VARIABLE] = str(out)
    here = str(Path(__file__).resolve().parent)  # the workers import this file by name
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    code = pytest.main(["-p", "suite_profile", *theirs])
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    print("\n".join(summary(rows, opts.top)))
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
