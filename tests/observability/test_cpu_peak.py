"""The CPU peak behind MFU is one number per machine, so identical runs log comparable MFU."""

import json

import pytest

from jaxtrain.observability.hardware import CPU_PEAK_FILE, cached_cpu_peak, machine_signature

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
