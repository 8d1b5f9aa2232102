"""Ring attention (models/ring.py) on 4 simulated devices equals one device: attention
outputs and gradients (packed, windowed, soft-capped rows), and training steps on sp = 4
meshes (ring_worker.py runs in a subprocess: XLA_FLAGS must be set before jax loads)."""

from __future__ import annotations

import numpy as np
from common import run_worker


def run_ring(*args: str) -> object:
    return run_worker("ring_worker.py", *args)


def test_ring_attention_equals_one_device():
    errors = run_ring("attention")  # the worker asserts rtol 1e-5 on every array
    assert len(errors) == 16
    assert max(errors.values()) < 1e-5


def test_training_on_an_sp4_mesh_equals_one_device(tmp_path):
    one = run_ring("train,1,1,1,1,1", str(tmp_path / "one"))
    ring = run_ring("train,1,1,1,1,4", str(tmp_path / "sp4"))
    ring_tp = run_ring("train,1,1,1,2,2", str(tmp_path / "tp2_sp2"))
    assert len(one) == 2
    np.testing.assert_allclose(ring, one, rtol=1e-5)
    np.testing.assert_allclose(ring_tp, one, rtol=1e-5)
