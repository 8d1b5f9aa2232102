"""attention.causal_attention's own XLA path against jax.nn.dot_product_attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models.attention import (
    BLOCKWISE_MIN_LENGTH,
    attention_probs,
    causal_attention,
    causal_mask,
    default_implementation,
    grouped_attention,
    softmax_attention,
)

B, T, N, H = 2, 12, 4, 8


def qkv(kv_heads: int, seed: int = 0, t: int = T):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (B, t, N, H)),
        jax.random.normal(kk, (B, t, kv_heads, H)),
        jax.random.normal(kv, (B, t, kv_heads, H)),
    )


def segments(t: int) -> jax.Array:
    """Two documents in row 0; one and padding (segment 0) in row 1."""
    return jnp.asarray(
        [[1] * (t // 3) + [2] * (t - t // 3), [1] * (3 * t // 4) + [0] * (t - 3 * t // 4)]
    )


# 12 positions: one block; 384: two query blocks of 192 (blocked_causal_attention).
@pytest.mark.parametrize("t", [12, 384])
@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [None, 3, 200])
def test_equals_jax_attention_with_gqa_segments_and_windows(t, kv_heads, packed, window):
    q, k, v = qkv(kv_heads, t=t)
    segment_ids = segments(t) if packed else None
    mask = None
    if packed:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    expected = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
    )
    got = causal_attention(q, k, v, segment_ids=segment_ids, sliding_window=window)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # Gradients too: training differentiates through this path.
    loss = lambda f: lambda q, k, v: (f(q, k, v) ** 2).sum()  # noqa: E731
    ours = jax.grad(loss(lambda *a: causal_attention(*a, segment_ids=segment_ids,
                                                      sliding_window=window)), (0, 1, 2))(q, k, v)  # fmt: skip
    ref = jax.grad(loss(lambda *a: jax.nn.dot_product_attention(
        *a, mask=mask, is_causal=True,
        local_window_size=None if window is None else (window - 1, 0))), (0, 1, 2))(q, k, v)  # fmt: skip
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def softmax_as_written(q, k, v, mask, scale):
    """The attention softmax_attention computes, left to JAX's autodiff."""
    scores = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    probs = attention_probs(scores, q.shape[3], mask, scale=scale)
    return jnp.einsum("bnts,bsnh->btnh", probs.astype(v.dtype), v)


def weighted_sum(f):
    weights = jax.random.normal(jax.random.key(9), (B, T, N, H))
    return lambda q, k, v: (f(q, k, v) * weights.astype(q.dtype)).sum(dtype=jnp.float32)


@pytest.mark.parametrize("packed", [False, True])
def test_softmax_attention_backward_equals_autodiff_of_the_softmax(packed):
    """Its own backward pass (from the probabilities alone) against differentiating the
    softmax as written, on a causal mask, packed segments with padding, and one row that sees
    no key at all (uniform probabilities, zero gradient to its scores)."""
    q, k, v = qkv(4, seed=3)
    mask = causal_mask(T, segment_ids=segments(T) if packed else None)
    mask = jnp.broadcast_to(mask, (B, 1, T, T)).at[1, 0, 2].set(False)  # row 2 of batch 1
    ours = lambda q, k, v: softmax_attention(q, k, v, mask, 0.3)  # noqa: E731
    ref = lambda q, k, v: softmax_as_written(q, k, v, mask, 0.3)  # noqa: E731
    np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), rtol=1e-6, atol=1e-6)
    got = jax.grad(weighted_sum(ours), (0, 1, 2))(q, k, v)
    want = jax.grad(weighted_sum(ref), (0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"d{name}")
    # bf16 inputs: bf16 gradients, as close to the float32 ones as autodiff's own
    low = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
    got16 = jax.grad(weighted_sum(ours), (0, 1, 2))(*low)
    want16 = jax.grad(weighted_sum(ref), (0, 1, 2))(*low)
    for a16, r16, b in zip(got16, want16, want, strict=True):
        assert a16.dtype == jnp.bfloat16
        ours_err = float(jnp.abs(a16.astype(jnp.float32) - b).max())
        autodiff_err = float(jnp.abs(r16.astype(jnp.float32) - b).max())
        assert ours_err <= 1.5 * autodiff_err + 1e-3


def test_softmax_attention_keeps_one_score_sized_array_for_the_backward():
    """What the backward pass holds on to (the leaves of jax.vjp's function): differentiating
    the softmax as written keeps the masked scores, their exponentials and the probabilities
    (and the mask); softmax_attention keeps the probabilities alone."""
    q, k, v = qkv(4, seed=4)
    mask = jnp.broadcast_to(causal_mask(T), (B, 1, T, T))

    def kept(f) -> list[tuple[tuple[int, ...], str]]:
        _, backward = jax.vjp(lambda q, k, v: f(q, k, v, mask, 0.25), q, k, v)
        leaves = jax.tree.leaves(backward)
        return [(x.shape, str(x.dtype)) for x in leaves if x.shape[-2:] == (T, T)]

    assert sorted(kept(softmax_attention)) == [((B, 1, T, T), "bool"), ((B, N, T, T), "float32")]
    assert len(kept(softmax_as_written)) >= 3


def test_bf16_inputs_keep_float32_scores():
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(2, seed=1))
    out = causal_attention(q, k, v)
    assert out.dtype == jnp.bfloat16
    ref = causal_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2)


def test_logit_cap_bounds_the_scores():
    q, k, v = qkv(4, seed=2)
    q = q * 50.0  # huge scores: capped at 1.0 they become nearly uniform
    capped = grouped_attention(q, k, v, None, logit_cap=1e-3)
    np.testing.assert_allclose(
        capped, jnp.broadcast_to(v.mean(1, keepdims=True), v.shape), atol=1e-3
    )


def test_unknown_implementation_names_the_field():
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match="attention_implementation='flash'"):
        causal_attention(q, k, v, implementation="flash")


def test_rotary_tables_of_traced_positions_equal_the_constant_ones():
    """Packed rows pass positions as arrays (traced); the default 0..T-1 are numpy
    constants. Both give the same tables, laid out as HF's rotate_half expects."""
    from jaxtrain.models.layers import rope_cos_sin, rope_inv_freq

    inv_freq = rope_inv_freq(16, 10000.0)
    positions = np.array([[0, 1, 2, 0, 1, 5, 6, 7]], np.int32)
    want_cos, want_sin = rope_cos_sin(positions, inv_freq, jnp.float32)
    traced = jax.jit(lambda p: rope_cos_sin(p, inv_freq, jnp.float32))
    got_cos, got_sin = traced(jnp.asarray(positions))
    np.testing.assert_allclose(got_cos, want_cos, atol=1e-6)
    np.testing.assert_allclose(got_sin, want_sin, atol=1e-6)
    assert got_cos.shape == (1, 8, 16)
    np.testing.assert_array_equal(got_cos[..., :8], got_cos[..., 8:])  # halves repeat
    np.testing.assert_allclose(got_sin[0, 5, :8], np.sin(5 * inv_freq), atol=1e-6)


def pick(**overrides) -> str:
    """default_implementation for an H100 bf16 Llama layer at 4096 tokens, with overrides."""
    settings = dict(
        platform="gpu", compute_capability=9.0, dtype="bfloat16", head_dim=64, length=4096,
        logit_cap=None, sequence_parallel=False,
    )  # fmt: skip
    return default_implementation(**{**settings, **overrides})


def test_the_default_is_cudnn_on_a_gpu_only_where_the_kernel_applies():
    assert pick() == "cudnn"
    assert pick(dtype="float16", head_dim=128, length=16) == "cudnn"
    # Each condition the fused kernel needs, broken one at a time:
    assert pick(platform="cpu") == "blockwise"
    assert pick(platform="cpu", length=512) == "xla"
    assert pick(compute_capability=7.5) == "blockwise"  # before Ampere
    assert pick(dtype="float32", length=512) == "xla"
    assert pick(head_dim=256) == "blockwise" and pick(head_dim=100) == "blockwise"
    assert pick(logit_cap=50.0) == "blockwise"  # Gemma 2's soft-capping
    assert pick(sequence_parallel=True) == "blockwise"  # ring attention over sp


def test_the_default_on_this_cpu_is_what_it_was():
    """None on CPU: dense below BLOCKWISE_MIN_LENGTH, blockwise from it on (same numbers)."""
    q, k, v = qkv(2, seed=3)
    np.testing.assert_array_equal(
        causal_attention(q, k, v), causal_attention(q, k, v, implementation="xla")
    )
    t = BLOCKWISE_MIN_LENGTH
    q, k, v = (x[:1, :1].repeat(t, axis=1) for x in qkv(2, seed=4))
    np.testing.assert_array_equal(
        causal_attention(q, k, v), causal_attention(q, k, v, implementation="blockwise")
    )
