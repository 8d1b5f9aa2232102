"""The CPU peak behind MFU is one number per machine, so identical runs log comparable MFU."""

import json

import pytest
from obs_helpers import obs_trainer

from jaxtrain.observability.hardware import (
    CPU_PEAK_FILE,
    cached_cpu_peak,
    cpu_peak,
    cpu_shares,
    forget_cpu_peak,
    machine_signature,
    measured_cpu_peak,
    remeasure_cpu_peak,
)
from jaxtrain.observability.logs import read_jsonl

PROBE = dict(size=256, seconds=0.05, min_repeats=2)  # the mechanism, not the real probe


def test_the_cpu_peak_is_measured_once_and_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXTRAIN_CPU_PEAK_TFLOPS", raising=False)
    first = cached_cpu_peak(tmp_path, **PROBE)
    stored = json.loads((tmp_path / CPU_PEAK_FILE).read_text())
    assert stored["peak_flops"] == first > 1e8 and stored["machine"] == machine_signature()
    # A second run reads the stored value instead of probing again: pin it to prove it.
    stored["peak_flops"] = 1.25e11
    (tmp_path / CPU_PEAK_FILE).write_text(json.dumps(stored))
    assert cached_cpu_peak(tmp_path, **PROBE) == 1.25e11
    # The number of another machine is not trusted: probed again and replaced.
    stored["machine"] = "elsewhere"
    (tmp_path / CPU_PEAK_FILE).write_text(json.dumps(stored))
    again = cached_cpu_peak(tmp_path, **PROBE)
    assert again != 1.25e11 and json.loads((tmp_path / CPU_PEAK_FILE).read_text())["machine"] == (
        machine_signature()
    )


def test_the_cpu_peak_can_be_set_by_hand(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXTRAIN_CPU_PEAK_TFLOPS", "0.5")
    assert cached_cpu_peak(tmp_path, **PROBE) == pytest.approx(0.5e12)
    assert not (tmp_path / CPU_PEAK_FILE).exists()


def test_every_cpu_peak_says_where_it_came_from(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXTRAIN_CPU_PEAK_TFLOPS", raising=False)
    first = cpu_peak(tmp_path, **PROBE)
    assert first.source == "measured" and first.measured_at is not None
    again = cpu_peak(tmp_path, **PROBE)
    assert (again.source, again.flops, again.measured_at) == (
        "cached",
        first.flops,
        first.measured_at,
    )
    # A run beat the peak: probed again; the probe is stored, not the run's figure (1e20
    # FLOP/s is no 2-core CPU's: a FLOPs count or a window's time was wrong).
    raised = remeasure_cpu_peak(1e20, tmp_path, **PROBE)
    try:
        assert raised.source == "remeasured" and 1e8 < raised.flops < 1e13
        assert json.loads((tmp_path / CPU_PEAK_FILE).read_text())["peak_flops"] == raised.flops
        assert measured_cpu_peak() == raised.flops  # this process uses it from now on
    finally:
        forget_cpu_peak()
    assert cpu_peak(tmp_path, **PROBE).to_json()["source"] == "cached"
    monkeypatch.setenv("JAXTRAIN_CPU_PEAK_TFLOPS", "0.5")
    assert cpu_peak(tmp_path, **PROBE).source == "environment"


@pytest.fixture
def stale_cpu_peak(tmp_path, monkeypatch):
    """A cache holding a peak measured under heavy load: far below what the CPU does."""
    monkeypatch.delenv("JAXTRAIN_CPU_PEAK_TFLOPS", raising=False)
    monkeypatch.setenv("JAXTRAIN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    stale = {"machine": machine_signature(), "peak_flops": 1e6, "measured": 1.0}
    (tmp_path / "cache" / CPU_PEAK_FILE).write_text(json.dumps(stale))
    forget_cpu_peak()
    yield tmp_path / "cache" / CPU_PEAK_FILE
    forget_cpu_peak()  # later tests read the real cache again


def test_a_run_that_beats_a_stale_cached_peak_remeasures_it(tmp_path, stale_cpu_peak):
    """The demo logged MFU up to 138% against a peak measured under load; a run that beats
    the peak now probes again, stores the probe and never logs MFU above 100%."""
    out = tmp_path / "run"
    obs_trainer(
        out, report_to=[], max_steps=4, evaluation_strategy="no", track_memory=False
    ).train()
    logs = [r for r in read_jsonl(out / "metrics.jsonl") if "mfu" in r]
    assert logs and all(0 < r["mfu"] <= 1.0 for r in logs)
    stored = json.loads(stale_cpu_peak.read_text())["peak_flops"]
    # The stale 1e6 is replaced by a real probe (2 cores reach 1e10-1e12 FLOP/s), never by
    # the run's own figure (a wrong FLOPs count once stored 2.2e14 for this 2-core machine).
    assert 1e9 < stored < 1e13
    info = json.loads((out / "run_info.json").read_text())
    assert info["peak"]["source"] == "remeasured" and info["peak"]["measured_at"]
    assert info["peak"]["flops"] == pytest.approx(stored / cpu_shares())
    assert info["peak_tflops_per_device"] == pytest.approx(stored / cpu_shares() / 1e12)
