"""Blocked causal attention (seq >= 256) under sequence and tensor parallelism: the query
blocks slice a sequence-sharded axis, so XLA must move data between devices to compute them.
The losses must still equal one device's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from common import run_worker


def losses(dims: str, out: Path) -> list[float]:
    return run_worker("long_sequence_worker.py", dims, str(out))


def test_sequence_and_tensor_parallel_long_rows_train_like_one_device(tmp_path):
    one = losses("1,1,1,1,1", tmp_path / "one")
    sharded = losses("1,1,1,2,2", tmp_path / "tp2_sp2")
    assert len(one) == 2
    np.testing.assert_allclose(sharded, one, rtol=1e-5)
