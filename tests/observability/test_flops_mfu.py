"""FLOPs per token and MFU against numbers worked out by hand (formula in flops.py)."""

import jax
import numpy as np
import pytest
from obs_helpers import CONFIG, tiny_model

from jaxtrain.models import LlamaConfig
from jaxtrain.observability.flops import (
    FlopsCounter,
    attention_flops_per_token,
    dense_flops_per_token,
    flops_per_token,
    matmul_parameters,
    mean_attended_keys,
    sequence_lengths,
)
from jaxtrain.observability.hardware import device_peak_flops, measured_cpu_peak, table_peak
from jaxtrain.observability.metrics import MetricsWindow, host_token_count
from jaxtrain.trainers.data import PairCollator

# L=2 layers, d=64, H=4 query heads, K=2 kv heads, Q=16 head dim, I=128, V=512.
KNOWN = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_dense_and_attention_flops_match_hand_computed_values():
    # N_matmul = L*(d*Q*(2H+2K) + 3*d*I) + d*V = 2*(64*16*12 + 3*64*128) + 64*512
    #          = 2*(12288 + 24576) + 32768 = 106496
    assert matmul_parameters(KNOWN) == 106_496
    assert dense_flops_per_token(KNOWN) == 6 * 106_496 == 638_976
    # attention at T=32: 12*L*H*Q*c = 12*2*4*16*c = 1536*c
    # causal c = (32+1)/2 = 16.5 -> 25344; full attention c = 32 -> 49152
    assert attention_flops_per_token(KNOWN, 32) == 25_344
    assert attention_flops_per_token(KNOWN, 32, causal=False) == 49_152
    assert flops_per_token(KNOWN, 32) == 638_976 + 25_344
    assert flops_per_token(KNOWN, 32, causal=False) == 638_976 + 49_152
    # The attention term grows with the actual length: T=1024 -> c = 512.5
    assert attention_flops_per_token(KNOWN, 1024) == 1536 * 512.5


def test_sliding_window_caps_the_keys_a_query_sees():
    # T=8, window 4: positions 1..4 see 1..4 keys (10), positions 5..8 see 4 each (16)
    assert mean_attended_keys(8, window=4) == pytest.approx(26 / 8)
    assert mean_attended_keys(3, window=4) == 2.0  # shorter than the window: plain causal


def test_matmul_parameters_are_the_models_own_matrices():
    """The formula counts exactly the kernels of the real model (not embeddings, norms)."""
    model = tiny_model()
    from flax import nnx

    params = nnx.state(model, nnx.Param)
    kernels = sum(
        int(np.prod(x.shape))
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
        if "kernel" in jax.tree_util.keystr(path)
    )
    assert matmul_parameters(LlamaConfig(**CONFIG)) == kernels


def test_batch_flops_use_each_sequences_real_length():
    counter = FlopsCounter(KNOWN, num_parameters=0)
    mask = np.zeros((2, 8), np.int32)
    mask[0, :3] = 1
    mask[1, :8] = 1
    batch = {"input_ids": np.ones((2, 8), np.int32), "attention_mask": mask}
    expected = 3 * flops_per_token(KNOWN, 3) + 8 * flops_per_token(KNOWN, 8)
    assert counter.batch_flops(batch) == pytest.approx(expected)
    # Packed rows: one length per document, never the row length.
    packed = {
        "input_ids": np.ones((1, 8), np.int32),
        "attention_mask": np.array([[1, 1, 1, 1, 1, 1, 0, 0]]),
        "segment_ids": np.array([[1, 1, 2, 2, 2, 2, 0, 0]]),
    }
    assert sorted(sequence_lengths(packed).tolist()) == [2, 4]
    expected = 2 * flops_per_token(KNOWN, 2) + 4 * flops_per_token(KNOWN, 4)
    assert counter.batch_flops(packed) == pytest.approx(expected)


def test_preference_pairs_count_the_rejected_side_too():
    counter = FlopsCounter(KNOWN, num_parameters=0)
    pair = {"chosen_input_ids": [1, 2, 3, 4, 5], "chosen_labels": [-100, -100, 3, 4, 5]}
    pair |= {"rejected_input_ids": [1, 2, 7], "rejected_labels": [-100, -100, 7]}
    batch = PairCollator(seq_len=8)([pair, pair])
    expected = 2 * (5 * flops_per_token(KNOWN, 5) + 3 * flops_per_token(KNOWN, 3))
    assert counter.batch_flops(batch) == pytest.approx(expected)
    assert host_token_count(batch, counter).flops == pytest.approx(expected)


def test_a_model_without_a_transformer_config_falls_back_to_6n():
    counter = FlopsCounter(None, num_parameters=1000)
    batch = {"input_ids": np.ones((2, 5), np.int32)}
    assert counter.batch_flops(batch) == 6 * 1000 * 10


def test_mfu_is_model_flops_per_second_per_device_over_the_peak():
    window = MetricsWindow(num_devices=4, peak_flops=1e30)  # far above what the window does
    metrics = {
        "loss_sum": np.float32(20.0),
        "tokens": np.float32(10.0),
        "correct": np.float32(5.0),
        "learning_rate": np.float32(1e-3),
        "grad_norm": np.float32(1.0),
    }
    # 10 target tokens, 16 positions, 2 sequences, 8e12 model FLOPs
    window.add(metrics, (10, 16, 2, 8e12))
    logs = window.close(1, epoch=0.0).read()
    seconds = 10 / logs["tokens_per_second"]
    assert logs["tflops_per_device"] == pytest.approx(8e12 / seconds / 4 / 1e12)
    assert logs["mfu"] == pytest.approx(logs["tflops_per_device"] * 1e12 / 1e30)
    # A peak below what the window achieved is wrong: MFU is never logged above 100%.
    window = MetricsWindow(num_devices=4, peak_flops=1.0)
    window.add(metrics, (10, 16, 2, 8e12))
    assert window.close(1, epoch=0.0).read()["mfu"] == 1.0
    assert logs["loss"] == 2.0 and logs["accuracy"] == 0.5
    # No peak (device not in the table): TFLOP/s yes, MFU no.
    window = MetricsWindow(peak_flops=None)
    window.add(metrics, (10, 16, 2, 8e12))
    logs = window.close(1, epoch=0.0).read()
    assert "tflops_per_device" in logs and "mfu" not in logs


@pytest.mark.parametrize(
    ("kind", "name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756),
        ("NVIDIA H200", "H200", 989),
        ("NVIDIA A100-SXM4-80GB", "A100", 312),
        ("TPU v4", "TPU v4", 275),
        ("TPU v5 lite", "TPU v5e", 197),
        ("TPU v5p", "TPU v5p", 459),
        ("TPU v5", "TPU v5p", 459),
        ("TPU v6 lite", "TPU v6e", 918),
    ],
)
def test_peak_table(kind, name, tflops):
    assert table_peak(kind) == (name, tflops * 1e12)


def test_unknown_devices_have_no_peak_and_cpu_is_measured_once():
    assert table_peak("NVIDIA GeForce RTX 4090") is None
    peak = measured_cpu_peak()
    assert 1e8 < peak < 1e14 and measured_cpu_peak() == peak  # read once per process
    description, per_device = device_peak_flops(jax.devices("cpu")[0])
    assert "CPU" in description and per_device == pytest.approx(
        peak / len(jax.local_devices(backend="cpu"))
    )


def test_the_first_step_s_time_counts_in_its_window(tmp_path):
    """The first window waits for step 1 (the CPU peak is probed on an idle device); that wait
    is step time. It was excluded with the probe, so a one-step window timed ~0 s and logged
    an absurd FLOP/s (2.2e14 on 2 cores), which the peak correction then stored."""
    import datasets
    from flax import nnx

    from jaxtrain import Trainer, TrainingArguments
    from jaxtrain.models import LlamaForCausalLM
    from jaxtrain.observability.hardware import cpu_shares, probe_cpu_peak
    from jaxtrain.observability.logs import read_jsonl

    # Big enough that a step's compute, not its dispatch, is most of its time.
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    rows = np.random.default_rng(0).integers(1, 511, size=(64, 128)).tolist()
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=3, logging_steps=1, total_batch_size=8,
        max_sequence_length=128, progress_bar="none", run_report=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
    dataset = datasets.Dataset.from_dict({"input_ids": rows})
    Trainer(arguments=args, model=model, dataset_train=dataset).train()
    logs = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "step_time_s" in r]
    # No window can beat the machine: the first windows logged 1-9 TFLOP/s per device where
    # a fresh probe of these 2 cores finds ~0.1-0.2.
    peak = probe_cpu_peak() / cpu_shares()
    assert all(r["tflops_per_device"] * 1e12 <= 1.5 * peak for r in logs), (peak, logs)
