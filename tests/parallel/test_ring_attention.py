"""Ring attention (models/ring.py) on 4 simulated devices equals one device: attention
outputs and gradients (packed, windowed, soft-capped rows), and training steps on sp = 4
meshes (ring_worker.py runs in a subprocess: XLA_FLAGS must be set before jax loads)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from common import worker_env

HERE = Path(__file__).parent


def run_worker(*args: str) -> object:
    proc = subprocess.run(
        [sys.executable, str(HERE / "ring_worker.py"), *args],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ring_attention_equals_one_device():
    errors = run_worker("attention")  # the worker asserts rtol 1e-5 on every array
    assert len(errors) == 16
    assert max(errors.values()) < 1e-5


def test_training_on_an_sp4_mesh_equals_one_device(tmp_path):
    one = run_worker("train,1,1,1,1,1", str(tmp_path / "one"))
    ring = run_worker("train,1,1,1,1,4", str(tmp_path / "sp4"))
    ring_tp = run_worker("train,1,1,1,2,2", str(tmp_path / "tp2_sp2"))
    assert len(one) == 2
    np.testing.assert_allclose(ring, one, rtol=1e-5)
    np.testing.assert_allclose(ring_tp, one, rtol=1e-5)
