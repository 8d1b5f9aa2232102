"""Muon under fsdp and tp sharding: the orthogonalisation sees each whole matrix.

Inside `jit` an optimizer update is a function of the global (logical) arrays: XLA's SPMD
partitioner turns Newton-Schulz's matmuls over a matrix split by fsdp (its input features)
and tp (its output features) into sharded matmuls plus the collectives that make them the
whole matrix's, and the Frobenius norm into a global one. So the update on a mesh is the
one-device update up to the order of float sums; this checks it, and that a Muon run stopped
and resumed on the mesh is bit-exact (its optimizer state: momentum per matrix, AdamW moments
for the rest, round-trips sharded)."""

from __future__ import annotations

import json

from common import run_worker


def test_muon_on_dp_fsdp_tp_equals_one_device_and_resumes_bit_exact(tmp_path):
    run_worker("muon_worker.py", str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    update = results["update"]
    assert update["max_rel"] < 1e-6, update["max_rel"]
    # The matrices were really split (by the rules: embed over fsdp, heads/mlp over tp).
    specs = update["muon_shardings"]
    assert any("fsdp" in s and "tp" in s for s in specs.values()), specs
    assert results["resume"] == 0.0
