"""bench/suite_profile.py records, per test of a real pytest run, the JAX compiles it made."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURED = """
import jax
import jax.numpy as jnp


def test_compiles_a_program():
    assert float(jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3))[0]) > 1


def test_compiles_nothing():
    assert 1 + 1 == 2
"""


def test_each_test_gets_its_wall_and_compile_seconds_and_the_files_summary(tmp_path):
    (tmp_path / "test_measured.py").write_text(MEASURED)
    out = tmp_path / "profile.jsonl"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "suite_profile.py"), "--out", str(out), "--",
         "-q", "-p", "no:cacheprovider", "-n", "0", str(tmp_path / "test_measured.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"test_compiles_a_program", "test_compiles_nothing"}
    compiled, idle = rows["test_compiles_a_program"], rows["test_compiles_nothing"]
    assert compiled["programs"] >= 1 and compiled["compile"] > 0 and compiled["trace"] > 0
    assert idle["programs"] == 0 and "compile" not in idle
    assert all(r["wall"] > 0 for r in rows.values())
    assert "test_measured.py" in done.stdout and "programs" in done.stdout
