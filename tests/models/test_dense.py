"""`layers.dense`: token-wise projections as one 2-D matmul, equal to the einsum they replace,
and with a weight gradient that XLA:CPU compiles without an activation-sized transpose. The
output head in a 16-bit dtype (`layers.output_head`): the reference's values and gradients,
without a float32 copy of its weights."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models.layers import dense, dense_in_ndim, output_head


@pytest.mark.parametrize(
    ("equation", "in_ndim", "x_shape", "kernel_shape"),
    [
        ("btd,df->btf", 1, (2, 5, 6), (6, 7)),  # MLP
        ("btd,dkgh->btkgh", 1, (2, 5, 6), (6, 2, 3, 4)),  # fused q/k/v
        ("btnh,nhd->btd", 2, (2, 5, 3, 4), (3, 4, 6)),  # attention output
        ("bd,dl->bl", 1, (3, 6), (6, 5)),  # a classifier: one lead dim
        ("bcpd,de->bcpe", 1, (2, 3, 4, 6), (6, 5)),  # three lead dims
    ],
)
def test_dense_equals_the_einsum_forward_and_backward(equation, in_ndim, x_shape, kernel_shape):
    assert dense_in_ndim(equation) == in_ndim
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=kernel_shape), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=jnp.einsum(equation, x, kernel).shape), jnp.float32)

    def loss(f):
        return lambda x, k: jnp.sum(f(x, k) * cotangent)

    want = jax.value_and_grad(loss(lambda x, k: jnp.einsum(equation, x, k)), argnums=(0, 1))
    got = jax.value_and_grad(loss(lambda x, k: dense(x, k, in_ndim)), argnums=(0, 1))
    (want_value, want_grads), (got_value, got_grads) = want(x, kernel), got(x, kernel)
    np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_equations_that_are_not_token_wise_matmuls_stay_einsums():
    assert dense_in_ndim("btd,vd->btv") is None  # kernel contracted on its last dim
    assert dense_in_ndim("nd,edcf->necf") is None  # an expert dim between
    assert dense_in_ndim("btd,df->bft") is None  # output dims reordered


def _activation_transposes(hlo: str, activation_elements: int) -> list[str]:
    """Instructions of the optimized HLO that copy or transpose an activation-sized array."""
    found = []
    for line in hlo.splitlines():
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = f32\[([\d,]*)\]\S* (\w+)\(", line)
        if not match or match.group(3) not in ("copy", "transpose", "fusion"):
            continue
        name, dims = match.group(1), match.group(2)
        elements = int(np.prod([int(d) for d in dims.split(",") if d]))
        if elements >= activation_elements and ("copy" in name or "transpose" in name):
            found.append(line.strip()[:160])
    return found


def test_swiglu_weight_gradient_compiles_without_activation_transposes():
    """The regression this guards: as [B, T, D] einsums, XLA:CPU (jaxlib 0.10) transposed
    every [B, T, F] gradient into [F, B * T] for the weight gradients (1.8x slower MLP
    backward); this check finds six such copies in the einsum spelling and must find none here."""
    b, t, d, f = 4, 64, 32, 128
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(d, f)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(f, d)), jnp.float32)

    def loss(weights, x):
        gate, up, down = weights
        return jnp.sum(dense(jax.nn.silu(dense(x, gate)) * dense(x, up), down) ** 2)

    hlo = jax.jit(jax.grad(loss)).lower((gate, up, down), x).compile().as_text()
    assert _activation_transposes(hlo, b * t * f) == []


@pytest.mark.parametrize("tied", [False, True])
def test_a_16_bit_head_equals_the_plain_matmul_forward_and_backward(tied):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(2, 5, 16)), jnp.bfloat16)
    shape = (40, 16) if tied else (16, 40)
    weights = jnp.asarray(rng.normal(size=shape), jnp.float32)  # float32 master weights
    cotangent = jnp.asarray(rng.normal(size=(2, 5, 40)), jnp.bfloat16)

    def reference(h, weights):
        matrix = weights.astype(jnp.bfloat16)
        return jnp.einsum("btd,dv->btv", h, matrix.T if tied else matrix)

    def head(h, weights):
        return output_head(weights, jnp.bfloat16, tied=tied)(h)

    got, got_vjp = jax.vjp(head, h, weights)
    want, want_vjp = jax.vjp(reference, h, weights)
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for g, w in zip(got_vjp(cotangent), want_vjp(cotangent), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2)


def test_a_16_bit_head_s_backward_makes_no_float32_copy_of_its_weights():
    """XLA:CPU has no bf16-output matmul: the head `h @ W.astype(bf16)` converted W to float32
    first, in the forward and in autodiff's backward (a float32 cotangent times bf16 weights).
    At hidden 1024 and vocab 32000 that copy (125 MiB) was a QLoRA step's largest temporary."""
    h = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
    weights = jax.ShapeDtypeStruct((1024, 32000), jnp.bfloat16)

    def loss(h, weights):
        logits = output_head(weights, jnp.bfloat16, tied=False)(h).astype(jnp.float32)
        return jax.nn.log_softmax(logits).sum()

    compiled = jax.jit(jax.grad(loss)).lower(h, weights).compile()
    float32_weights = 1024 * 32000 * 4
    assert compiled.memory_analysis().temp_size_in_bytes < float32_weights / 2
