"""Throughput counts real target tokens; padding is reported separately and never in MFU."""

import json

import jax
import numpy as np
import pytest
from obs_helpers import CONFIG, ROW_LEN, SEQ

from jaxtrain.data import collate_examples
from jaxtrain.models import LlamaConfig
from jaxtrain.observability.flops import FlopsCounter, flops_per_token
from jaxtrain.observability.logs import read_jsonl
from jaxtrain.observability.metrics import host_token_count


def test_a_batch_with_known_padding_gives_the_known_counts():
    rows = [{"input_ids": list(range(1, n + 1))} for n in (3, 5, 8)]
    batch = collate_examples(rows, seq_len=8, pad_token_id=0)
    config = LlamaConfig(**CONFIG)
    counts = host_token_count(batch, FlopsCounter(config, 0))
    # targets: each row predicts n - 1 tokens -> 2 + 4 + 7; positions 3 x 8
    assert (counts.targets, counts.positions, counts.sequences) == (13, 24, 3)
    expected = sum(n * flops_per_token(config, n) for n in (3, 5, 8))
    assert counts.flops == pytest.approx(expected)


def test_logged_throughput_counts_only_real_tokens(resumed_run):
    records = [r for r in read_jsonl(resumed_run.out_dir / "metrics.jsonl") if "loss" in r]
    info = json.loads((resumed_run.out_dir / "run_info.json").read_text())
    assert records
    per_token = flops_per_token(LlamaConfig(**CONFIG), ROW_LEN)
    for r in records:
        # Each row: 10 real tokens -> 9 targets, padded to 16 positions.
        ratio = r["tokens_per_second"] / r["padded_tokens_per_second"]
        assert ratio == pytest.approx((ROW_LEN - 1) / SEQ)
        assert r["sequences_per_second"] / r["padded_tokens_per_second"] == pytest.approx(1 / SEQ)
        # FLOPs count the 10 real tokens of each row at their actual length.
        flops_per_target = r["tflops_per_device"] * 1e12 * jax.device_count()
        flops_per_target /= r["tokens_per_second"]
        assert flops_per_target == pytest.approx(per_token * ROW_LEN / (ROW_LEN - 1), rel=1e-6)
        assert r["mfu"] == pytest.approx(
            r["tflops_per_device"] / info["peak_tflops_per_device"], rel=1e-6
        )
        assert r["step_time_s"] > 0 and 0 <= r["data_wait_fraction"] <= 1
        assert r["data_wait_s"] >= 0
        assert np.isfinite(r["grad_norm"]) and r["learning_rate"] > 0
        assert r["memory/host_rss_gib"] > 0.05
