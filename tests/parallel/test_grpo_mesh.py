"""A GRPO update on a 4-device dp=2 x fsdp=2 mesh equals one device's, on fixed completions
(num_iterations 2: the second update uses the old log-probs and the clip; beta > 0)."""

from __future__ import annotations

import numpy as np
from common import run_worker


def test_dp_fsdp_mesh_gives_the_update_of_one_device(tmp_path):
    info = run_worker("grpo_worker.py", str(tmp_path))
    assert info["single"] == {"devices": 1, "sharded": False, "steps": 2}
    assert info["dp2_fsdp2"] == {"devices": 4, "sharded": True, "steps": 2}
    one, mesh = np.load(tmp_path / "single.npz"), np.load(tmp_path / "dp2_fsdp2.npz")
    assert sorted(one.files) == sorted(mesh.files)
    for key in one.files:  # "<update>_<leaf>": after each of the two updates
        np.testing.assert_allclose(mesh[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)
    second = [k for k in one.files if k.startswith("1_")]
    # The second update (on the old log-probs) moved the parameters: not a vacuous match.
    assert any(not np.allclose(one[k], one["0_" + k[2:]]) for k in second)


def test_a_resume_inside_a_round_on_the_mesh_is_exact(tmp_path):
    """Stopped inside a round on a dp=2 x fsdp=2 mesh and resumed: the checkpoint's round
    batch comes back sharded like the generated one, and the run ends bit-equal."""
    info = run_worker("grpo_resume_worker.py", str(tmp_path))
    assert "extra" in info["extra"], info  # the save at step 3 kept the round's batch
    assert info["steps"] == [4] and info["same_completions"], info
    assert info["batch"] == info["batch_whole"] and info["batch"][0] == 4, info
    whole, resumed = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    for key in whole.files:
        np.testing.assert_array_equal(resumed[key], whole[key], err_msg=key)
