"""blocks.gated and blocks.gelu: the same values and gradients as the activations written
out, keeping only their inputs for the backward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain.models.blocks import gated, gelu, gelu_tanh

SHAPE = (2, 6, 16)


def arrays(n: int) -> list[jax.Array]:
    return [jax.random.normal(key, SHAPE) * 3 for key in jax.random.split(jax.random.key(0), n)]


def kept_for_backward(f, *xs) -> list[tuple[int, ...]]:
    """Activation-sized arrays the vjp function holds (the residuals of the backward pass)."""
    _, backward = jax.vjp(f, *xs)
    return [x.shape for x in jax.tree.leaves(backward) if x.shape == SHAPE]


@pytest.mark.parametrize("activation", [jax.nn.silu, gelu_tanh], ids=["silu", "gelu_tanh"])
def test_gated_equals_the_product_and_keeps_only_gate_and_up(activation):
    gate, up = arrays(2)
    written = lambda g, u: activation(g) * u  # noqa: E731
    ours = lambda g, u: gated(activation, g, u)  # noqa: E731
    np.testing.assert_allclose(ours(gate, up), written(gate, up), rtol=1e-6)
    loss = lambda f: lambda g, u: (f(g, u) * jnp.cos(g)).sum()  # noqa: E731
    got = jax.grad(loss(ours), (0, 1))(gate, up)
    want = jax.grad(loss(written), (0, 1))(gate, up)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert len(kept_for_backward(ours, gate, up)) == 2
    assert len(kept_for_backward(written, gate, up)) >= 3


@pytest.mark.parametrize("act", ["gelu", "gelu_new"])
def test_gelu_keeps_only_its_input(act):
    (x,) = arrays(1)
    written = lambda x: jax.nn.gelu(x, approximate=act == "gelu_new")  # noqa: E731
    np.testing.assert_allclose(gelu(x, act), written(x), rtol=1e-6)
    np.testing.assert_allclose(
        jax.grad(lambda x: gelu(x, act).sum())(x), jax.grad(lambda x: written(x).sum())(x),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    assert len(kept_for_backward(lambda x: gelu(x, act), x)) == 1
    assert len(kept_for_backward(written, x)) >= 2
