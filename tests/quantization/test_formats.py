"""NF4 and int8 blockwise formats: NF4 equals bitsandbytes' own quantize_4bit/dequantize_4bit
on the same weights (its CPU path), int8 and double quantization within their error bounds."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.quantization import NF4_TABLE, dequantize, quantize


def weights(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(scale=0.05, size=n).astype(np.float32)


def test_nf4_equals_bitsandbytes_codes_scales_and_values():
    torch = pytest.importorskip("torch")
    functional = pytest.importorskip("bitsandbytes.functional")
    w = weights(64 * 48)
    packed, state = functional.quantize_4bit(torch.tensor(w), blocksize=64, quant_type="nf4")
    ours = quantize(jnp.asarray(w)[:, None], "nf4", 64)  # one column: bnb's flat order
    np.testing.assert_array_equal(np.asarray(ours.codes).ravel(), packed.numpy().ravel())
    np.testing.assert_allclose(np.asarray(ours.scales).ravel(), state.absmax.numpy(), rtol=1e-7)
    np.testing.assert_array_equal(np.asarray(NF4_TABLE), state.code.numpy())
    want = functional.dequantize_4bit(packed, state).numpy().ravel()
    np.testing.assert_allclose(np.asarray(dequantize(ours)).ravel(), want, rtol=1e-6)


def test_blocks_run_along_the_rows_of_each_column():
    w = weights(128 * 3, seed=1).reshape(128, 3)
    q = quantize(jnp.asarray(w), "nf4", 64)
    assert q.codes.shape == (64, 3) and q.scales.shape == (2, 3)
    np.testing.assert_allclose(np.asarray(q.scales), np.abs(w).reshape(2, 64, 3).max(1))
    # Every value lands on the NF4 level nearest its normalised value.
    error = np.abs(np.asarray(dequantize(q)) - w) / np.repeat(np.asarray(q.scales), 64, 0)
    assert error.max() <= np.diff(NF4_TABLE).max() / 2 + 1e-6


def test_int8_and_double_quantization_error_bounds():
    w = weights(256 * 4, seed=2).reshape(256, 4)
    per_channel = quantize(jnp.asarray(w), "int8", 256)  # one scale per column
    assert per_channel.codes.dtype == jnp.int8 and per_channel.scales.shape == (1, 4)
    step = np.abs(w).max(0) / 127
    assert (np.abs(np.asarray(dequantize(per_channel)) - w) <= step / 2 + 1e-7).all()
    single, double = (quantize(jnp.asarray(w), "nf4", 8, double=d) for d in (False, True))
    assert double.scales.dtype == jnp.int8 and double.scales_scale.shape == (1, 4)
    # The scales lose at most half an int8 step of their group's largest.
    scale_error = np.abs(np.asarray(dequantize(double)) - np.asarray(dequantize(single)))
    assert scale_error.max() <= np.abs(w).max() / 127 + 1e-6
