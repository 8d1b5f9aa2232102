"""bench/accelerator.py (the one-command GPU campaign) in its tiny mode on CPU, so it never rots:
every stage runs in its own process and its figures land in accelerator.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def campaign(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("accelerator")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "accelerator.py"),
            "--tiny",
            "--out",
            str(out),
            "--variants",
            "cudnn,blockwise,auto,bf16_moments,scan,fused",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((out / "accelerator.json").read_text()), out


def test_train_variants_report_the_trainers_figures(campaign):
    report, _ = campaign
    assert report["device"]["platform"] == "cpu"
    # cudnn and the fused Triton kernels have no CPU build: the campaign leaves them out there.
    assert set(report["train"]) == {"blockwise", "auto", "bf16_moments", "scan"}
    assert report["train"]["bf16_moments"]["overrides"] == {"mu_dtype": "bfloat16"}
    assert report["train"]["scan"]["overrides"] == {"scan_layers": True}
    for name, result in report["train"].items():
        assert "error" not in result, (name, result)
        assert result["tokens_per_second"] > 0 and 0 < result["mfu"] <= 1
        assert result["window_steps"] == "5-6"
        assert result["compiled_memory"]["peak"] > 0
        assert "memory/host_rss_gib" in result["memory"]  # the monitor's track_memory keys
    # Same weights, same rows: the attention kernels compute the same loss (bf16 compute).
    losses = [r["loss"] for r in report["train"].values()]
    assert max(losses) - min(losses) < 1e-2 * max(losses)


def test_generation_engine_and_batch_stages(campaign):
    report, out = campaign
    gen = report["generate"]
    assert gen["new_tokens_per_row"] == 8 and gen["new_tokens_per_second"] > 0
    # No Pallas kernel on CPU (it is the GPU's or TPU's).
    assert set(report["engine"]) == {"gather", "steps8"}
    for engine in report["engine"].values():
        assert engine["new_tokens_per_row"] == 8 and engine["new_tokens_per_second"] > 0
        # New prompts of known lengths: the timed call compiles nothing.
        assert engine["shapes_compiled_in_second_call"] == 0
        # The first token alone and with the tiny run's 2 prompts together, warm.
        assert engine["clients"] == 2 and engine["shapes_compiled_while_timed"] == 0
        assert engine["first_token_lone_s"] > 0 and engine["first_token_ratio"] > 0
    # Eight steps a call decode the tokens of single steps.
    one, eight = (np.load(out / f"engine-{name}.npz") for name in ("gather", "steps8"))
    np.testing.assert_array_equal(one["tokens"], eight["tokens"])
    assert "needs both" in report["engine_agreement"]["error"]
    batch = report["batch"]
    small, large = batch["compiled"]
    assert large["batch"] == 2 * small["batch"]
    assert large["memory"]["temporaries"] > small["memory"]["temporaries"]
    # XLA:CPU reports no device memory limit: the stage says so instead of guessing.
    assert "no memory limit" in batch["error"]


def test_plan_is_compared_with_the_measured_run(campaign):
    report, out = campaign
    plan = report["plan"]
    assert "error" not in plan, plan
    measured = report["train"]["blockwise"]["compiled_memory"]["peak"]
    assert plan["peak_bytes"] == pytest.approx(measured, rel=0.05)
    assert plan["estimate"]["compute_s"] > 0
    table = (out / "accelerator.md").read_text()
    assert "| blockwise | none | 2 x 128 |" in table and "jaxtrain plan" in table


def test_profile_stage_traces_the_steady_steps(campaign):
    report, out = campaign
    profile = report["profile"]
    assert profile["window_steps"] == "5-6"
    trace = profile["trace"]
    assert trace["source"] == "host XLA threads"  # no device process on XLA:CPU
    assert trace["events"] > 0 and trace["kernels"]
    # Two steps of a 2-layer model: each traced kernel ran a multiple of 2 times.
    odd = [(name, count) for name, _, count in trace["kernels"] if count % 2]
    assert not odd, odd
    assert list((out / "trace").rglob("perfetto_trace.json.gz"))


def test_moe_stage_trains_the_twin_with_each_dispatch(campaign):
    report, out = campaign
    moe = report["moe"]
    # On CPU the blocked loop and the GPU kernel's own code (interpreted) stand in.
    assert set(moe) == {"blocks", "interpret"}
    for impl, result in moe.items():
        assert "error" not in result, (impl, result)
        assert result["moe"] == impl and result["window_steps"] == "5-6"
        assert result["tokens_per_second"] > 0 and 0 < result["mfu"] <= 1
    # Same weights, same rows, an exact dispatch each: the same loss (bf16 compute).
    losses = [r["loss"] for r in moe.values()]
    assert max(losses) - min(losses) < 1e-3 * max(losses)
    table = (out / "accelerator.md").read_text()
    assert "moe (interpret):" in table and "the dense step's" in table
    # One grouped matmul: the kernel's code (interpreted) gives ragged_dot's numbers.
    kernels = report["gmm"]["kernels"]
    assert set(kernels) == {"ragged_dot", "pallas"}  # JAX's Mosaic-GPU kernel: Hopper only
    assert kernels["pallas"]["max_abs_diff_from_ragged_dot"] < 0.05  # bf16, 32-long sums
    assert all(k["ms"] > 0 for k in kernels.values()) and "(pallas):" in table


def test_grpo_stage_times_sync_async_and_8_decode_steps_a_call(campaign):
    report, out = campaign
    grpo = report["grpo"]
    assert set(grpo) == {"sync", "async", "steps8"}
    for name, result in grpo.items():
        assert "error" not in result, (name, result)
        assert result["step_s"] > 0 and result["steady_steps"] == "3-4"
    assert grpo["sync"]["weight_handoff_s"] is None  # nothing is handed to a round ahead
    assert grpo["async"]["max_staleness"] == 1 and grpo["async"]["weight_handoff_s"] > 0
    assert [grpo[k]["decode_steps"] for k in ("sync", "async", "steps8")] == [1, 1, 8]
    table = (out / "accelerator.md").read_text()
    assert "grpo async / sync:" in table and "grpo steps8 / sync:" in table
