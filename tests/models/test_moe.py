"""Mixture-of-experts: exact dropless dispatch, capacity, router losses, the loss contract."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models.moe import MoeConfig, MoeForCausalLM
from jaxtrain.models.moe_dispatch import (
    capacity,
    dense_reference,
    expert_mlp,
    route,
    router_losses,
)
from jaxtrain.observability.flops import matmul_parameters
from jaxtrain.training.step import causal_lm_loss_sums, causal_lm_sums

N, D, F, E, K = 40, 16, 12, 6, 2


@pytest.fixture(scope="module")
def routed():
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (N, D))
    gate_up = 0.3 * jax.random.normal(keys[1], (E, D, 2, F))
    down = 0.3 * jax.random.normal(keys[2], (E, F, D))
    # Skewed logits: some experts get many rows, one none at all.
    logits = jax.random.normal(keys[3], (N, E)) + jnp.array([2.0, 1.0, 0.0, 0.0, -0.5, -9.0])
    weights, experts, _ = route(logits, K, normalize=True)
    return x, experts, weights, gate_up, down, logits


# "interpret" and "interpret_tpu": the GPU's and the TPU's Pallas kernels, their own code.
@pytest.mark.parametrize("implementation", ["blocks", "ragged_dot", "interpret", "interpret_tpu"])
def test_dropless_dispatch_equals_every_expert_on_every_token(routed, implementation):
    x, experts, weights, gate_up, down, _ = routed
    assert int((experts == 5).sum()) == 0  # an expert without rows is handled

    # Compiled, as in a model: run eagerly, every op of the dispatch is a program of its own.
    @jax.jit
    def ours(x, weights, gate_up, down):
        return expert_mlp(x, experts, weights, gate_up, down, implementation=implementation)

    @jax.jit
    def reference(x, weights, gate_up, down):
        return dense_reference(x, experts, weights, gate_up, down)

    np.testing.assert_allclose(ours(*routed[:1], weights, gate_up, down),
                               reference(x, weights, gate_up, down), rtol=1e-5, atol=1e-5)  # fmt: skip
    # Gradients too (the blocked matmul has its own VJP), for inputs, weights and routing.
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    ours_g = jax.grad(loss(ours), argnums=(0, 1, 2, 3))(x, weights, gate_up, down)
    ref_g = jax.grad(loss(reference), argnums=(0, 1, 2, 3))(x, weights, gate_up, down)
    for a, b in zip(ours_g, ref_g, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    # Expert parallel: each of 3 "devices" holds 2 experts; their partial sums add up.
    parts = [
        expert_mlp(
            x,
            experts,
            weights,
            gate_up[i : i + 2],
            down[i : i + 2],
            first_expert=i,
            num_experts=E,
            implementation=implementation,
        )  # fmt: skip
        for i in (0, 2, 4)
    ]
    np.testing.assert_allclose(sum(parts), reference(x, weights, gate_up, down), atol=1e-5)


def test_capacity_drops_the_latest_rows_of_an_overfull_expert(routed):
    x, experts, weights, gate_up, down, _ = routed
    factor = 0.6
    cap = capacity(N, K, E, factor)
    assert cap == int(np.ceil(0.6 * N * K / E))
    kept = np.asarray(weights).copy()
    seen = np.zeros(E, int)
    for n in range(N):  # rows in token order; an expert keeps its first `cap`
        for k in range(K):
            e = int(experts[n, k])
            kept[n, k] *= seen[e] < cap
            seen[e] += 1
    assert (kept == 0).any() and (kept != 0).any()
    expected = dense_reference(x, experts, jnp.asarray(kept), gate_up, down)
    for implementation in ("blocks", "ragged_dot", "interpret", "interpret_tpu"):
        got = expert_mlp(x, experts, weights, gate_up, down, capacity_factor=factor,
                         implementation=implementation)  # fmt: skip
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_router_losses_by_hand(routed):
    *_, logits = routed
    logits = np.asarray(logits, np.float64)
    weights, experts, probs = route(jnp.asarray(logits, jnp.float32), K, normalize=False)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(probs, p, rtol=1e-5)
    top = np.argsort(-p, axis=-1)[:, :K]
    np.testing.assert_array_equal(np.sort(experts, -1), np.sort(top, -1))
    np.testing.assert_allclose(weights, np.take_along_axis(p, np.asarray(experts), -1), rtol=1e-5)

    fraction = np.array([(top == e).sum() for e in range(E)]) / N  # tokens per expert / N
    balance = E * np.sum(fraction * p.mean(0))
    lse = np.log(np.exp(logits).sum(-1))
    got_balance, got_z = router_losses(jnp.asarray(logits, jnp.float32), experts, E)
    np.testing.assert_allclose(got_balance, balance, rtol=1e-5)
    np.testing.assert_allclose(got_z, np.mean(lse**2), rtol=1e-5)
    # Perfectly even routing gives k.
    even = router_losses(jnp.zeros((6, E)), jnp.arange(12).reshape(6, 2) % E, E)[0]
    np.testing.assert_allclose(even, K, rtol=1e-6)


CONFIG = MoeConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=24,
    mlp_only_layers=[1],
    router_aux_loss_coef=0.05,
    router_z_loss_coef=0.01,
    model_type="qwen2_moe",
)


@pytest.fixture(scope="module")
def model():
    return MoeForCausalLM(CONFIG, rngs=nnx.Rngs(0))


def test_model_parameters_layers_and_active_flops(model):
    params = nnx.state(model, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == CONFIG.num_parameters()
    layers = model.model.layers
    assert hasattr(layers[0].mlp, "gate_up") and not hasattr(layers[1].mlp, "gate_up")
    axes = layers[0].mlp.gate_up.get_metadata()["logical_axes"]
    assert axes[0] == "expert"
    # FLOPs count the active experts only: 2 of 4 experts' weights per sparse layer.
    d = CONFIG.hidden_size
    full = CONFIG.num_parameters()
    inactive = 2 * (2 * 3 * d * CONFIG.moe_intermediate_size)  # two sparse layers
    tables = CONFIG.vocab_size * d  # the embedding lookup is not a matmul
    norms = d * (2 * 3 + 1)  # RMSNorm weights: not matmuls
    assert matmul_parameters(CONFIG) == full - inactive - tables - norms


def test_default_loss_adds_the_router_losses_and_logs_them(model):
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, CONFIG.vocab_size)
    labels = ids.at[0, :4].set(-100)
    batch = {"input_ids": ids, "labels": labels}
    sums = nnx.jit(causal_lm_loss_sums)(model, batch, jax.random.key(0))
    logits, aux = nnx.jit(lambda m, ids: m(ids, return_aux=True))(model, ids)
    plain = causal_lm_sums(logits, labels)
    tokens = float(plain["tokens"])
    assert float(sums["tokens"]) == tokens == 2 * 11 - 3
    balance, z = float(aux["router_balance"]), float(aux["router_z"])
    assert balance > 0 and z > 0
    expected = float(plain["loss_sum"]) + tokens * (0.05 * balance + 0.01 * z)
    np.testing.assert_allclose(float(sums["loss_sum"]), expected, rtol=1e-6)
    np.testing.assert_allclose(float(sums["router_balance_sum"]), tokens * balance, rtol=1e-6)
    np.testing.assert_allclose(float(sums["router_z_sum"]), tokens * z, rtol=1e-6)
    # The aux values are the means over the two sparse layers of each layer's losses.
    x = model.model.embed_tokens(ids)
    assert aux["router_balance"].shape == () and x.shape == (2, 12, 32)

    # The router gets gradient from the balance loss alone (cross-entropy ignored).
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def aux_only(params):
        _, aux = nnx.merge(graphdef, params, rest)(ids, return_aux=True)
        return aux["aux_loss"]

    grads = jax.jit(jax.grad(aux_only))(params)
    router_grad = grads["model"]["layers"][0]["mlp"]["gate"]["kernel"].get_value()
    assert float(jnp.abs(router_grad).max()) > 0


def test_config_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoeConfig(num_experts=2, num_experts_per_tok=3)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoeConfig(capacity_factor=0)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        MoeConfig(num_hidden_layers=2, mlp_only_layers=[5])
    with pytest.raises(ValueError, match="model_type"):
        MoeConfig(model_type="llama")
    with pytest.raises(ValueError, match="MoeConfig"):
        MoeForCausalLM(MoeConfig().__class__.__mro__[1](), rngs=nnx.Rngs(0))
