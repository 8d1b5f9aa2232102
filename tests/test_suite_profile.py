"""bench/suite_profile.py records, per test of a real pytest run, its wall and CPU seconds and the
JAX compiles it made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURED = """
import subprocess
import sys
import time

import jax
import jax.numpy as jnp


def test_compiles_a_program():
    assert float(jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3))[0]) > 1


def test_compiles_nothing():
    assert 1 + 1 == 2


def test_waits():
    time.sleep(0.5)


def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "sum(range(3 * 10**7))"], check=True)
"""


def test_each_test_gets_its_wall_and_compile_seconds_and_the_files_summary(tmp_path):
    (tmp_path / "test_measured.py").write_text(MEASURED)
    out = tmp_path / "profile.jsonl"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "suite_profile.py"), "--out", str(out), "--",
         "-q", "-p", "no:cacheprovider", "-n", "0", str(tmp_path / "test_measured.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        # A worker's variable, as a pytest started inside an xdist worker's test inherits it.
        env={**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.2",
             "PYTEST_XDIST_WORKER": "gw7"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {
        "test_compiles_a_program", "test_compiles_nothing", "test_waits", "test_starts_a_process"
    }  # fmt: skip
    compiled, idle = rows["test_compiles_a_program"], rows["test_compiles_nothing"]
    assert compiled["programs"] >= 1 and compiled["compile"] > 0 and compiled["trace"] > 0
    assert idle["programs"] == 0 and "compile" not in idle
    assert all(r["wall"] > 0 for r in rows.values())
    # One process (-n 0): one worker, its tests one after the other.
    assert {r["worker"] for r in rows.values()} == {"main"}
    begins = [r["start"] for r in map(json.loads, out.read_text().splitlines())]
    assert begins == sorted(begins)
    # A jitted sin compiles well under 0.2 s: a program no disk cache would keep.
    assert compiled["small_programs"] >= 1
    assert 0 < compiled["small_compile"] <= compiled["compile"]
    # A sleep is wall time without CPU; a process the test waited for is child CPU.
    waits, starts = rows["test_waits"], rows["test_starts_a_process"]
    assert waits["wall"] >= 0.5 and waits["cpu"] < 0.25 and waits["child_cpu"] < 0.05
    assert starts["child_cpu"] > 0.2 and starts["cpu"] < starts["child_cpu"]
    assert "test_measured.py" in done.stdout and "child cpu s" in done.stdout
    assert "workers: main 0.0-" in done.stdout
