"""Behaviour of LlamaConfig, the layers and LlamaForCausalLM on tiny float32 configs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain.models import REMAT_POLICIES, LlamaConfig, LlamaForCausalLM, logical_axes
from jaxtrain.models.layers import rope_inv_freq

AXIS_NAMES = {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "qkv", "gate_up", None}


def tiny(**overrides) -> LlamaConfig:
    base = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        # Larger than HF's 0.02 so that logits differ visibly between inputs.
        initializer_range=0.2,
    )
    base.update(overrides)
    return LlamaConfig(**base)


def build(cfg: LlamaConfig, seed: int = 0, **kw) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed), **kw)


@nnx.jit
def fwd(model, ids, positions=None, segment_ids=None):
    # Jitted: one compile per model/shape is much faster than op-by-op eager dispatch.
    return model(ids, positions=positions, segment_ids=segment_ids)


def ids_for(cfg: LlamaConfig, shape, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.RandomState(seed).randint(0, cfg.vocab_size, size=shape))


def param_count(model: nnx.Module) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# ------------------------------------------------------------------------------ forward
def test_logits_shape_and_dtype():
    cfg = tiny()
    logits = fwd(build(cfg), ids_for(cfg, (3, 9)))
    assert logits.shape == (3, 9, cfg.vocab_size)
    assert logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_causal_future_tokens_do_not_change_past_logits():
    cfg = tiny()
    model = build(cfg)
    ids = ids_for(cfg, (2, 12))
    changed = ids.at[:, 7:].set((ids[:, 7:] + 5) % cfg.vocab_size)
    a, b = fwd(model, ids), fwd(model, changed)
    np.testing.assert_allclose(a[:, :7], b[:, :7], atol=1e-6)
    assert float(jnp.abs(a[:, 7:] - b[:, 7:]).max()) > 1e-3


def test_packed_documents_are_isolated_by_segment_ids():
    cfg = tiny()
    model = build(cfg)
    doc_a, doc_b = ids_for(cfg, (1, 5), seed=1), ids_for(cfg, (1, 7), seed=2)
    packed = jnp.concatenate([doc_a, doc_b], axis=1)
    segments = jnp.asarray([[1] * 5 + [2] * 7])
    positions = jnp.asarray([list(range(5)) + list(range(7))])
    out = fwd(model, packed, positions=positions, segment_ids=segments)
    np.testing.assert_allclose(out[:, :5], fwd(model, doc_a), atol=1e-5)
    np.testing.assert_allclose(out[:, 5:], fwd(model, doc_b), atol=1e-5)
    # Without segment ids document b would see document a: the check above has teeth.
    leaky = fwd(model, packed, positions=positions)
    assert float(jnp.abs(leaky[:, 5:] - fwd(model, doc_b)).max()) > 1e-3


def test_sliding_window_limits_influence_to_the_window():
    # One layer: with more layers the receptive field grows by (window - 1) per layer.
    window = 3
    cfg = tiny(num_hidden_layers=1, sliding_window=window)
    model = build(cfg)
    ids = ids_for(cfg, (1, 10))
    changed = ids.at[0, 2].set((ids[0, 2] + 1) % cfg.vocab_size)
    delta = jnp.abs(fwd(model, ids) - fwd(model, changed)).max(axis=(0, 2))
    # HF Mistral rule: token i sees token j iff 0 <= i - j < window.
    for i in range(10):
        if 0 <= i - 2 < window:
            assert delta[i] > 1e-4, f"position {i} should see position 2"
        else:
            assert delta[i] < 1e-6, f"position {i} must not see position 2"


def test_gqa_matches_mha_with_repeated_kv_weights():
    gqa_cfg = tiny(num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    mha_cfg = tiny(num_attention_heads=4, num_key_value_heads=4, attention_bias=True)
    gqa, mha = build(gqa_cfg, seed=1), build(mha_cfg, seed=2)
    group = 2  # query heads per kv head in the GQA model; query head n uses kv head n // 2
    weights = nnx.to_pure_dict(nnx.state(gqa, nnx.Param))  # everything else copied as is
    for layer in weights["model"]["layers"].values():
        qkv = layer["self_attn"]["qkv_proj"]
        kernel, bias = np.asarray(qkv["kernel"]), np.asarray(qkv["bias"])  # (D,2,4,H), (2,4,H)
        # MHA slot layout per head: (q, k, v); take q from its group slot, k/v repeated.
        pick = [[g, group, group + 1] for g in range(group)]
        qkv["kernel"] = np.stack([kernel[:, n // group][:, pick[n % group]] for n in range(4)], 1)
        qkv["bias"] = np.stack([bias[n // group][pick[n % group]] for n in range(4)], 0)
    mha_state = nnx.state(mha, nnx.Param)
    nnx.replace_by_pure_dict(mha_state, weights)
    nnx.update(mha, mha_state)
    ids = ids_for(gqa_cfg, (2, 11))
    np.testing.assert_allclose(fwd(gqa, ids), fwd(mha, ids), atol=1e-5)
    assert mha.model.layers[0].self_attn.qkv_proj.kernel.shape == (32, 4, 3, 8)


def test_tied_embeddings_have_no_lm_head_and_reuse_the_table():
    cfg = tiny(tie_word_embeddings=True)
    model = build(cfg)
    assert model.lm_head is None
    params = nnx.state(model, nnx.Param)
    assert "lm_head" not in params
    assert param_count(model) == cfg.num_parameters()
    assert cfg.num_parameters() == tiny().num_parameters() - cfg.hidden_size * cfg.vocab_size
    # Output logits are the final hidden states times the (shared) embedding table.
    ids = ids_for(cfg, (1, 6))
    hidden = nnx.jit(lambda m, x: m.model(x, jnp.broadcast_to(jnp.arange(6), (1, 6))))
    expected = hidden(model, ids) @ model.model.embed_tokens.embedding[...].T
    np.testing.assert_allclose(fwd(model, ids), expected, atol=1e-5)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"attention_bias": True},
        {"mlp_bias": True},
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
        {"num_key_value_heads": 1, "head_dim": 16},
        {"num_key_value_heads": 4, "num_hidden_layers": 3},
    ],
)
def test_num_parameters_matches_the_state(overrides):
    cfg = tiny(**overrides)
    assert param_count(build(cfg)) == cfg.num_parameters()


# --------------------------------------------------------------------------------- rope
def test_llama3_inv_freq_matches_the_formula_by_hand():
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    head_dim, theta = 16, 500000.0
    expected = []
    for i in range(0, head_dim, 2):
        f = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / f
        if wavelen < 64 / 4.0:  # high frequency: unchanged
            expected.append(f)
        elif wavelen > 64 / 1.0:  # low frequency: divided by factor
            expected.append(f / 8.0)
        else:  # interpolate between f / factor and f
            s = (64 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append((1 - s) * f / 8.0 + s * f)
    got = rope_inv_freq(head_dim, theta, scaling)
    np.testing.assert_allclose(got, np.asarray(expected), rtol=1e-6)
    # The three regimes are all exercised by these numbers.
    plain = rope_inv_freq(head_dim, theta)
    ratio = plain / got
    assert ratio[0] == pytest.approx(1.0) and ratio[-1] == pytest.approx(8.0)
    assert any(1.01 < r < 7.99 for r in ratio)
    linear = rope_inv_freq(head_dim, theta, {"type": "linear", "factor": 2.0})
    np.testing.assert_allclose(linear, plain / 2.0, rtol=1e-6)


# -------------------------------------------------------------------------------- remat
def test_every_remat_policy_gives_the_same_gradient():
    cfg = tiny()
    model = build(cfg)
    model.scan_layers = False  # the jaxpr counts one remat per layer (a scan traces one layer)
    ids = ids_for(cfg, (2, 8))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def grads_for(policy: str):
        model.remat_policy = policy
        gdef = nnx.split(model, nnx.Param, ...)[0]

        def loss(p):
            logits = nnx.merge(gdef, p, rest)(ids)
            logp = jax.nn.log_softmax(logits[:, :-1])
            return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
        return jax.jit(jax.grad(loss))(params), jaxpr

    reference, plain_jaxpr = grads_for("none")
    # Without a policy the only remat is the MLP's gated activation (blocks.gated), one a layer.
    assert plain_jaxpr.count("remat2[") == cfg.num_hidden_layers
    for policy in REMAT_POLICIES[1:]:
        grads, jaxpr = grads_for(policy)
        assert jaxpr.count("remat2[") > cfg.num_hidden_layers, policy
        for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(grads)):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=policy)


def test_unknown_remat_policy_is_rejected():
    model = build(tiny())
    model.remat_policy = "full"
    with pytest.raises(ValueError, match="remat_policy"):
        model(jnp.zeros((1, 4), jnp.int32))


# --------------------------------------------------------------------------------- dtype
def test_bf16_compute_keeps_fp32_params():
    cfg = tiny()
    model = build(cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    logits = fwd(model, ids_for(cfg, (2, 7)))
    assert logits.dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isfinite(logits.astype(jnp.float32))))
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.float32)}
    # bf16 logits stay close to the fp32 model with the same weights.
    ref = fwd(build(cfg), ids_for(cfg, (2, 7)))
    assert float(jnp.abs(logits.astype(jnp.float32) - ref).max()) < 0.1


# -------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "head_dim"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"vocab_size": -1}, "vocab_size"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny(**overrides)


def test_config_dict_round_trip_and_unknown_keys():
    cfg = tiny(rope_scaling={"type": "linear", "factor": 4.0}, sliding_window=16)
    d = cfg.to_dict()
    assert d["num_key_value_heads"] == 2 and d["head_dim"] == 8
    assert d["rope_scaling"]["rope_type"] == "linear"
    again = LlamaConfig.from_dict(d)
    assert again == cfg and hash(again) == hash(cfg)
    with pytest.raises(ValueError, match="rope_thetaa"):
        LlamaConfig.from_dict({**d, "rope_thetaa": 1.0})
    assert LlamaConfig.from_dict({**d, "torch_dtype": "bfloat16"}, strict=False) == cfg
    assert LlamaConfig().num_key_value_heads == LlamaConfig().num_attention_heads


# -------------------------------------------------------------------- axes and sharding
def test_logical_axes_cover_every_param_dimension():
    cfg = tiny(attention_bias=True, mlp_bias=True)
    model = build(cfg)
    params = nnx.state(model, nnx.Param)
    axes = logical_axes(model)
    pairs = []
    jax.tree.map(
        lambda p, a: pairs.append((p, a)),
        params,
        axes,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    assert len(pairs) == len(jax.tree.leaves(params)) > 0
    for var, names in pairs:
        assert isinstance(names, tuple) and len(names) == var.ndim
        assert set(names) <= AXIS_NAMES
    qkv = axes["model"]["layers"][0]["self_attn"]["qkv_proj"]["kernel"]
    assert qkv == ("embed", "kv_heads", "qkv", "head_dim")
    assert logical_axes(params) == axes


def test_abstract_and_jitted_construction():
    cfg = tiny()
    abstract = nnx.eval_shape(lambda: build(cfg))
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(abstract, nnx.Param))
    assert jax.tree.leaves(logical_axes(abstract), is_leaf=lambda x: isinstance(x, tuple))

    @jax.jit
    def init():
        return nnx.state(build(cfg), nnx.Param)

    concrete = init()
    assert jax.tree.map(lambda x: (x.shape, x.dtype), concrete) == shapes
    eager = nnx.state(build(cfg), nnx.Param)
    for a, b in zip(jax.tree.leaves(concrete), jax.tree.leaves(eager)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_an_eager_build_draws_what_a_traced_build_draws():
    """Built eagerly, each weight's normal draw is one small compiled program (layers.py says
    why, with its options); built inside a trace (a ModelFactory's init, eval_shape), the same
    draw is traced, where a nested jit may carry no compiler options."""
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4)  # fmt: skip
    eager = nnx.state(LlamaForCausalLM(config, rngs=nnx.Rngs(3)), nnx.Param)
    traced = nnx.jit(lambda: nnx.state(LlamaForCausalLM(config, rngs=nnx.Rngs(3)), nnx.Param))()
    shapes = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(3)))
    assert jax.tree.map(jnp.shape, nnx.state(shapes, nnx.Param)) == jax.tree.map(jnp.shape, eager)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(traced), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    kernel = np.asarray(eager["model"]["layers"][0]["mlp"]["down_proj"]["kernel"])
    assert 0.015 < kernel.std() < 0.025  # initializer_range 0.02: a real draw, not zeros
