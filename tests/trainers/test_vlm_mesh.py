"""A vision-language model sharded on dp2 x fsdp2 x tp2 (8 CPU devices, a subprocess) trains as
on one device: the same losses and final weights, the vision tower's kernels sharded by the same
rules as the decoder's (issue 50)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np


def test_a_sharded_vlm_trains_as_one_device(tmp_path):
    worker = Path(__file__).with_name("vlm_mesh_worker.py")
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(worker), str(out)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    single, mesh = results["single"], results["dp2_fsdp2_tp2"]
    assert len(single["losses"]) == 3
    np.testing.assert_allclose(mesh["losses"], single["losses"], rtol=1e-5)
    assert mesh["norms"].keys() == single["norms"].keys()
    for name, norm in single["norms"].items():
        np.testing.assert_allclose(mesh["norms"][name], norm, rtol=1e-4, err_msg=name)
    tower = {k: v for k, v in mesh["specs"].items() if "vision_tower" in k and "kernel" in k}
    assert tower and any("fsdp" in v for v in tower.values()), tower
    assert any("tp" in v for v in tower.values()), tower
