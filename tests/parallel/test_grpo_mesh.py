"""A GRPO update on a 4-device dp=2 x fsdp=2 mesh equals one device's, on fixed completions
(num_iterations 2: the second update uses the old log-probs and the clip; beta > 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from common import worker_env

HERE = Path(__file__).parent


def test_dp_fsdp_mesh_gives_the_update_of_one_device(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(HERE / "grpo_worker.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["single"] == {"devices": 1, "sharded": False, "steps": 2}
    assert info["dp2_fsdp2"] == {"devices": 4, "sharded": True, "steps": 2}
    one, mesh = np.load(tmp_path / "single.npz"), np.load(tmp_path / "dp2_fsdp2.npz")
    assert sorted(one.files) == sorted(mesh.files)
    for key in one.files:  # "<update>_<leaf>": after each of the two updates
        np.testing.assert_allclose(mesh[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)
    second = [k for k in one.files if k.startswith("1_")]
    # The second update (on the old log-probs) moved the parameters: not a vacuous match.
    assert any(not np.allclose(one[k], one["0_" + k[2:]]) for k in second)
