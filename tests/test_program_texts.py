"""bench/program_texts.py logs every program of a real pytest run and finds those that differ
only in a constant, with the source line that made it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURED = """
import jax
import jax.numpy as jnp


def scaled_step(x, scale):
    return jnp.tanh(x) * scale  # the constant's use


def test_two_scales():
    for scale in (2.0, 3.0):  # one program each: the scale is baked in
        jax.jit(lambda x: scaled_step(x, scale))(jnp.ones(3)).block_until_ready()


def test_the_same_program_again():
    jax.jit(lambda x: scaled_step(x, 2.0))(jnp.ones(3)).block_until_ready()
"""


def test_programs_that_differ_only_in_a_constant_are_found_with_their_source(tmp_path):
    (tmp_path / "test_measured.py").write_text(MEASURED)
    out = tmp_path / "programs"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "program_texts.py"), "--out", str(out),
         "--save", "lambda", "--", "-q", "-p", "no:cacheprovider", "-n", "0",
         str(tmp_path / "test_measured.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    # Three calls, two texts, one text once the constants are masked.
    (lambdas,) = [line for line in lines if line.endswith("  jit__lambda")]
    assert lambdas.split()[:3] == ["3", "2", "1"], lambdas
    assert "saved texts: 1 without constants; 1 more only by constants:" in done.stdout
    used_at = lines[lines.index(next(x for x in lines if "stablehlo.constant" in x)) + 2]
    assert "test_measured.py:7" in used_at, done.stdout[-2000:]
    assert len(list(out.glob("text/*.mlir"))) == 2
