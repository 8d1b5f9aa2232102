"""Expert parallelism on 8 CPU devices (subprocess): ep splits the experts, and training on
(dp, fsdp, ep, tp) meshes equals one device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from common import worker_env

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("moe_meshes")
    proc = subprocess.run(
        [sys.executable, str(HERE / "moe_worker.py"), str(out)],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


def test_ep_meshes_train_like_one_device(moe_results):
    runs = moe_results["runs"]
    single = runs["single"]["losses"]
    assert len(single) == 2 and single[-1] < single[0]
    # The router losses are logged (per-token means, like the loss, which includes them).
    for logs in runs["single"]["logs"]:
        assert logs["router_balance"] >= 1.0 and logs["router_z"] > 0  # >= 1: k=2, unbalanced
        added = 0.01 * logs["router_balance"] + 0.001 * logs["router_z"]
        assert abs(logs["aux_loss"] - added) < 1e-5
    for name, run in runs.items():
        # SGD: the only differences are float32 reductions in another order.
        assert run["max_param_diff"] < 1e-5, (name, run["max_param_diff"])
        for a, b in zip(run["losses"], single, strict=True):
            assert abs(a - b) < 1e-5 * abs(b), (name, run["losses"], single)


def test_each_ep_device_holds_only_its_experts(moe_results):
    for name, ep in [("dp4_ep2", 2), ("fsdp2_ep4", 4), ("dp2_ep2_tp2", 2)]:
        shards = moe_results["runs"][name]["shards"]
        experts = {
            k: v for k, v in shards.items() if k.endswith("['gate_up']") or k.endswith("['down']")
        }
        assert len(experts) == 2  # gate_up and down
        for key, (full, shard) in experts.items():
            assert full[0] == 8 and shard[0] == 8 // ep, (name, key, full, shard)
        # Dense weights are not split over ep.
        router = next(v for k, v in shards.items() if k.endswith("['gate']['kernel']"))
        assert router[1][1] == 8


def test_dry_run_shows_the_expert_sharding(moe_results):
    lines = [line for line in moe_results["dry_run"].splitlines() if "mlp/gate_up" in line]
    assert len(lines) == 1
    for line in lines:
        assert "('expert', 'embed', 'gate_up', 'mlp')" in line and "'ep'" in line
        assert "(4, 32, 2, 32)" in line  # per-device shard: 4 of the 8 experts
