"""Schedules (training/schedules.py) and optimizers (training/optim.py) on a tiny NNX model."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from jaxtrain import TrainingArguments
from jaxtrain.config.tables import OPTIMIZERS, SCHEDULERS
from jaxtrain.errors import ArgumentError
from jaxtrain.training.optim import build_optimizer, muon_dimension_numbers
from jaxtrain.training.schedules import build_schedule, learning_rate_at

LR, TOTAL, WARMUP, MIN_RATIO = 2.0, 100, 10, 0.1
FLOOR = LR * MIN_RATIO

# ----------------------------------------------------------------------------------- schedules


def _values(schedule, steps):
    return [learning_rate_at(schedule, s) for s in steps]


def _build(name, **kw):
    args = dict(learning_rate=LR, total_steps=TOTAL, warmup_steps=WARMUP, min_lr_ratio=MIN_RATIO)
    return build_schedule(name, **{**args, **kw})


@pytest.mark.parametrize("name", SCHEDULERS)
def test_warmup_is_linear_from_lr_over_w_to_peak(name):
    # step s < W uses lr * (s + 1) / W: step 0 = lr/10, midpoint (step 4) = lr/2, step 9 = peak.
    got = _values(_build(name), [0, 4, 9, 10])
    np.testing.assert_allclose(got, [LR / 10, LR / 2, LR, LR], rtol=1e-6)


def test_constant_is_flat_after_warmup():
    np.testing.assert_allclose(_values(_build("constant"), [50, 100, 500]), [LR] * 3, rtol=1e-6)


def test_linear_decays_to_min_lr_at_total_steps():
    # 90 decay steps from step 10; step 55 is halfway: floor + (peak - floor) / 2.
    got = _values(_build("linear"), [55, 100, 200])
    np.testing.assert_allclose(got, [FLOOR + (LR - FLOOR) / 2, FLOOR, FLOOR], rtol=1e-6)


@pytest.mark.parametrize("name", ["cosine", "warmup_cosine", "warmup-cosine"])
def test_cosine_follows_the_formula(name):
    # step 40 is 1/3 of the way: floor + (peak - floor) * (1 + cos(pi / 3)) / 2.
    third = FLOOR + (LR - FLOOR) * 0.5 * (1 + math.cos(math.pi / 3))
    mid = FLOOR + (LR - FLOOR) * 0.5
    np.testing.assert_allclose(_values(_build(name), [40, 55, 100]), [third, mid, FLOOR], rtol=1e-5)


def test_wsd_is_stable_then_decays_in_the_last_fraction():
    sched = _build("wsd", wsd_decay_fraction=0.2)  # decay over steps 80..100
    got = _values(sched, [50, 79, 80, 90, 100, 120])
    mid = FLOOR + (LR - FLOOR) / 2
    np.testing.assert_allclose(got, [LR, LR, LR, mid, FLOOR, FLOOR], rtol=1e-6)


def test_no_warmup_starts_at_peak_and_min_ratio_zero_reaches_zero():
    sched = build_schedule("cosine", learning_rate=1.0, total_steps=10)
    np.testing.assert_allclose(_values(sched, [0, 5, 10]), [1.0, 0.5, 0.0], atol=1e-6)


def test_schedule_runs_under_jit():
    sched = _build("wsd")
    np.testing.assert_allclose(jax.jit(sched)(jnp.int32(4)), LR / 2, rtol=1e-6)


def optax_schedule(key, lr, total, warmup, ratio, fraction):
    """The same schedule composed of optax's own schedules: the reference."""
    peak, floor, decay_steps = lr, lr * ratio, total - warmup
    if key == "constant":
        main = optax.constant_schedule(peak)
    elif key == "linear":
        main = optax.linear_schedule(peak, floor, decay_steps)
    elif key in ("cosine", "warmup_cosine"):
        main = optax.cosine_decay_schedule(peak, decay_steps, ratio)
    else:
        decay = max(1, round(fraction * total))
        parts = [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay)]
        main = optax.join_schedules(parts, [decay_steps - decay])
    if not warmup:
        return main
    ramp = optax.linear_schedule(peak / warmup, peak, max(warmup - 1, 1))
    return optax.join_schedules([ramp, main], [warmup])


SCHEDULE_CASES = [
    (key, lr, total, warmup, ratio)
    for key in SCHEDULERS
    for lr, total, warmup, ratio in [(3e-4, 7, 0, 0.0), (0.0123, 100, 3, 0.37), (2.0, 100, 1, 0.1)]
    if key != "warmup_cosine" or warmup
]


@pytest.mark.parametrize("key, lr, total, warmup, ratio", SCHEDULE_CASES)
def test_schedules_are_optax_to_the_bit_and_take_traced_numbers(key, lr, total, warmup, ratio):
    ours = build_schedule(
        key, learning_rate=lr, total_steps=total, warmup_steps=warmup, min_lr_ratio=ratio,
        wsd_decay_fraction=0.2,
    )  # fmt: skip
    reference = optax_schedule(key, lr, total, warmup, ratio, 0.2)
    host_steps = [0, 1, 2, 5, 50, 99, 100, 120]
    assert _values(ours, host_steps) == _values(reference, host_steps)
    steps = jnp.arange(130, dtype=jnp.int32)
    want = jax.jit(jax.vmap(reference))(steps)
    np.testing.assert_array_equal(jax.jit(jax.vmap(ours))(steps), want)
    # One program for every set of numbers: here another schedule's, traced. XLA turns a
    # division by a constant into a product with its reciprocal, so with the steps traced the
    # rate is a few ulps from optax's compiled one, as that is from optax's own host values
    # (and optax's compiled linear decay to 0 ends at -1e-11, not at 0).
    by_numbers = jax.jit(lambda n, s: jax.vmap(ours.with_numbers(n))(s))
    other = build_schedule(key, learning_rate=lr / 3, total_steps=total + 9, warmup_steps=warmup,
                           min_lr_ratio=ratio / 2, wsd_decay_fraction=0.2)  # fmt: skip
    other_reference = optax_schedule(key, lr / 3, total + 9, warmup, ratio / 2, 0.2)
    for schedule, reference in ((ours, want), (other, jax.vmap(other_reference)(steps))):
        got = by_numbers(schedule.numbers, steps)
        np.testing.assert_allclose(got, reference, rtol=1e-6, atol=1e-7 * lr)
    assert by_numbers._cache_size() == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="warmup_cosine", warmup_steps=0), "warmup_steps > 0"),
        (dict(name="cosine", warmup_steps=100), "warmup_steps"),
        (dict(name="wsd", warmup_steps=95, wsd_decay_fraction=0.1), "wsd_decay_fraction"),
        (dict(name="linear", min_lr_ratio=1.5), "min_lr_ratio"),
        (dict(name="wsd", wsd_decay_fraction=0.0), "wsd_decay_fraction"),
        (dict(name="constant", total_steps=0), "total_steps"),
        (dict(name="constant", total_steps=10.5), "total_steps"),
        (dict(name="constant", learning_rate=-1.0), "learning_rate"),
    ],
)
def test_bad_schedule_arguments_raise(kwargs, match):
    args = dict(learning_rate=LR, total_steps=TOTAL, warmup_steps=WARMUP) | kwargs
    with pytest.raises(ValueError, match=match):
        build_schedule(args.pop("name"), **args)


def test_unknown_scheduler_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: constant, linear, cosine") as err:
        build_schedule("step", learning_rate=1.0, total_steps=10)
    assert "wsd" in str(err.value)


# ---------------------------------------------------------------------------------- optimizers

QKV_SHAPE = (4, 2, 3, 2)  # (embed, kv_heads, qkv, head_dim), fused like the Llama qkv kernel


class Tiny(nnx.Module):
    """Embedding, RMSNorm-like scale, a fused 4-D kernel and a Linear (kernel + bias)."""

    def __init__(self, rngs: nnx.Rngs):
        normal = jax.nn.initializers.normal(0.5)
        self.embedding = nnx.Param(normal(rngs.params(), (10, 4)), logical_axes=("vocab", "embed"))
        self.norm = nnx.Param(jnp.ones((4,)), logical_axes=("embed",))
        self.qkv = nnx.Param(
            normal(rngs.params(), QKV_SHAPE), logical_axes=("embed", "kv_heads", "qkv", "head_dim")
        )
        self.out = nnx.Linear(12, 3, rngs=rngs)

    def __call__(self, tokens):
        h = self.embedding[tokens]
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * self.norm[...]
        z = jnp.einsum("bd,dgqk->bgqk", h, self.qkv[...]).reshape(h.shape[0], -1)
        return self.out(jnp.tanh(z))


def _split(seed=0):
    graphdef, params, rest = nnx.split(Tiny(nnx.Rngs(seed)), nnx.Param, ...)
    return graphdef, params, rest


def _arrays(params):
    """{path: numpy array} for easy per-parameter checks."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]
    return {jax.tree_util.keystr(p): np.asarray(x[...] if is_var(x) else x) for p, x in flat}


def _regression():
    """(params, loss_fn): Tiny fitting another Tiny's outputs."""
    graphdef, params, rest = _split(0)
    _, teacher, _ = _split(1)
    tokens = jnp.arange(10) % 10
    target = nnx.merge(graphdef, teacher, rest)(tokens)

    def loss_fn(p):
        return jnp.mean((nnx.merge(graphdef, p, rest)(tokens) - target) ** 2)

    return params, loss_fn


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_reduces_a_regression_loss(name):
    params, loss_fn = _regression()
    tx = build_optimizer(name, 0.03, params, weight_decay=1e-4, clip_grad=10.0, momentum=0.5)
    opt_state = tx.init(params)

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    losses = []
    for _ in range(20):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_weight_decay_shrinks_matrices_and_spares_norms_and_biases(name):
    # Zero gradients: the only change is decoupled decay, p <- p * (1 - lr * wd), on ndim >= 2
    # (embedding included); 1-D norm scale and bias must stay bit-identical.
    _, params, _ = _split()
    lr, wd = 0.1, 0.5
    tx = build_optimizer(name, optax.constant_schedule(lr), params, weight_decay=wd)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    before, after = _arrays(params), _arrays(optax.apply_updates(params, updates))
    for key in ("['embedding']", "['qkv']", "['out']['kernel']"):
        np.testing.assert_allclose(after[key], before[key] * (1 - lr * wd), rtol=1e-5, err_msg=key)
    for key in ("['norm']", "['out']['bias']"):
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_clip_grad_scales_the_global_norm_before_sgd():
    _, params, _ = _split()
    lr, clip = 0.1, 1.0
    tx = build_optimizer("sgd", lr, params, clip_grad=clip, momentum=0.9)
    rng = np.random.default_rng(0)
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 1e3, x.dtype), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    g = _arrays(grads)
    norm = math.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in g.values()))
    assert norm > 100 * clip
    got = _arrays(updates)
    for key, grad in g.items():  # first step: momentum trace equals the clipped gradient
        np.testing.assert_allclose(got[key], -lr * grad * clip / norm, rtol=1e-5, err_msg=key)


def test_muon_dimension_numbers_follow_logical_axes():
    shapes = {
        "qkv": ((4, 2, 3, 2), ("embed", "kv_heads", "qkv", "head_dim")),
        "o_proj": ((2, 2, 4), ("heads", "head_dim", "embed")),
        "gate_up": ((4, 2, 8), ("embed", "gate_up", "mlp")),
        "down": ((8, 4), ("mlp", "embed")),
        "embedding": ((10, 4), ("vocab", "embed")),
        "lm_head": ((4, 10), ("embed", "vocab")),
        "norm": ((4,), ("embed",)),
    }
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, (s, _) in shapes.items()}
    axes = {k: a for k, (_, a) in shapes.items()}
    got = muon_dimension_numbers(params, axes)
    assert got["qkv"] == MuonDimensionNumbers(0, (1, 2, 3))
    assert got["o_proj"] == MuonDimensionNumbers((0, 1), 2)
    assert got["gate_up"] == MuonDimensionNumbers(0, (1, 2))
    assert got["down"] == MuonDimensionNumbers((0,), 1)
    assert got["embedding"] is None and got["lm_head"] is None and got["norm"] is None
    # The model's inputs and outputs that are not token tables go to AdamW too: a position
    # table or patch projection (unnamed input axis), a reward / classification head or the
    # MoE router (unnamed output axis); stacked experts are one matrix each.
    more = {
        "positions": ((16, 4), (None, "embed")),
        "score": ((4, 1), ("embed", None)),
        "experts_gate_up": ((3, 4, 2, 8), ("expert", "embed", "gate_up", "mlp")),
        "experts_down": ((3, 8, 4), ("expert", "mlp", "embed")),
    }
    got = muon_dimension_numbers(
        {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, (s, _) in more.items()},
        {k: a for k, (_, a) in more.items()},
    )
    assert got["positions"] is None and got["score"] is None
    assert got["experts_gate_up"] == MuonDimensionNumbers(1, (2, 3))
    assert got["experts_down"] == MuonDimensionNumbers((1,), 2)
    # Without logical axes (plain arrays): 2-D -> matrix, anything else -> Adam.
    plain = muon_dimension_numbers(params)
    assert plain["down"] == MuonDimensionNumbers(0, 1) and plain["embedding"] is not None
    assert plain["qkv"] is None and plain["norm"] is None


def test_muon_dimension_numbers_reject_mismatched_axes():
    params = {"w": jnp.zeros((4, 3))}
    with pytest.raises(ValueError, match=r"logical_axes\['w'\].*one name"):
        muon_dimension_numbers(params, {"w": ("embed",)})
    with pytest.raises(ValueError, match="one axis-name tuple per parameter"):
        muon_dimension_numbers(params, {"w": ("embed", "mlp"), "v": ("embed",)})


def test_muon_orthogonalises_the_fused_kernel_and_uses_adam_for_the_rest():
    _, params, _ = _split()
    lr = 0.01
    tx = build_optimizer("muon", lr, params)  # logical axes come from the nnx.Param metadata
    # A qkv gradient with spread-out singular values [4, 2, 1, 0.5] in its (embed, rest) layout.
    rng = np.random.default_rng(0)
    u, _ = np.linalg.qr(rng.normal(size=(4, 4)))
    v, _ = np.linalg.qr(rng.normal(size=(12, 4)))
    g_qkv = (u * np.array([4.0, 2.0, 1.0, 0.5])) @ v.T
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
    grads["qkv"][...] = jnp.asarray(g_qkv.reshape(QKV_SHAPE), jnp.float32)
    updates, _ = tx.update(grads, tx.init(params), params)
    got = _arrays(updates)
    update = got["['qkv']"].reshape(4, 12)
    sv = np.linalg.svd(update, compute_uv=False)
    # 5 Newton-Schulz steps leave singular values within ~[0.7, 1.1]; the gradient's ratio is 8
    # (adam-style or a wrong (reduction, output) grouping give ratios of ~3.4 and ~5.5 here).
    assert sv.max() / sv.min() < 2.0, sv
    polar = u @ v.T  # the exact orthogonalised direction; cosine(g, polar) is only 0.81
    cosine = np.sum(-update * polar) / (np.linalg.norm(update) * np.linalg.norm(polar))
    assert cosine > 0.95, cosine
    # Orthogonalised then scaled to RMS 0.2: singular values ~ 0.2 * sqrt(12).
    np.testing.assert_allclose(sv.mean() / lr, 0.2 * math.sqrt(12), rtol=0.25)
    # The embedding (vocab axis) and 1-D params go to plain AdamW (as Muon prescribes; optax's
    # contrib.muon gives them Nesterov Adam, whose first step is 1.47x larger), whose first
    # step is lr * sign(g) (bias-corrected m / sqrt(v) = g / |g|).
    g = _arrays(grads)
    for key in ("['embedding']", "['norm']", "['out']['bias']"):
        np.testing.assert_allclose(got[key], -lr * np.sign(g[key]), rtol=1e-4, err_msg=key)
    assert not np.allclose(np.abs(got["['qkv']"]), lr, rtol=0.1)


def test_unknown_optimizer_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: adamw, adafactor, lion, sgd, muon"):
        build_optimizer("adam_w2", 1e-3, {"w": jnp.zeros((2, 2))})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(clip_grad=-1.0), "clip_grad"),
        (dict(b2=1.0), "b2"),
        (dict(eps=0.0), "eps"),
    ],
)
def test_bad_optimizer_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_optimizer("adamw", 1e-3, {"w": jnp.zeros((2, 2))}, **kwargs)


def test_adam_betas_and_epsilon_reach_the_trainer_s_optimizer(tmp_path):
    # TrainingArguments.adam_beta1/adam_beta2/adam_epsilon: the Trainer's AdamW makes the
    # updates optax.adamw makes with those values (and not with the defaults).
    from tiny_run import tiny_arguments, tiny_model

    from jaxtrain import Trainer

    hyper = dict(adam_beta1=0.5, adam_beta2=0.6, adam_epsilon=1e-2)
    arguments = tiny_arguments(
        str(tmp_path),
        optimizer="adamw",
        scheduler="constant",
        warmup_steps=0,
        weight_decay=0.0,
        clip_grad=None,
        **hyper,
    )
    trainer = Trainer(arguments=arguments, model=tiny_model())
    params = trainer.create_state().params
    grads = [
        jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.key(i), p.shape), params)
        for i in range(3)
    ]

    def updates(tx):
        state, out = tx.init(params), []
        for g in grads:
            u, state = tx.update(g, state, params)
            out.append(u)
        return jax.tree.leaves(out)

    lr = arguments.learning_rate
    expected = updates(optax.adamw(lr, b1=0.5, b2=0.6, eps=1e-2, weight_decay=0.0))
    defaults = updates(optax.adamw(lr, weight_decay=0.0))
    got = updates(trainer.program.optimizer)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    assert any(not np.allclose(a, b, rtol=1e-3) for a, b in zip(got, defaults, strict=True))


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd", "muon"])
def test_mu_dtype_keeps_the_momentum_in_bfloat16_and_still_learns(name):
    """Each optimizer's first moment (momentum) is stored in mu_dtype; AdamW's second moment
    stays float32; the steps still reduce the loss like float32 moments do."""
    params, loss_fn = _regression()
    tx = build_optimizer(name, 0.03, params, momentum=0.5, mu_dtype="bfloat16")
    opt_state = tx.init(params)
    sizes = [x.size for x in jax.tree.leaves(params)]
    moments = [x for x in jax.tree.leaves(opt_state) if x.size in sizes]
    bf16 = [x for x in moments if x.dtype == jnp.bfloat16]
    # One momentum per parameter (Muon's AdamW branch: its own, for the rest)
    assert len(bf16) == len(sizes), [x.dtype for x in moments]
    if name == "adamw":  # nu: one more float32 array per parameter
        assert sum(x.dtype == jnp.float32 for x in moments) == len(sizes)
    losses = []
    for _ in range(20):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    assert all(x.dtype == jnp.bfloat16 for x in bf16)
    assert losses[-1] < 0.6 * losses[0], losses


def test_mu_dtype_is_checked():
    with pytest.raises(ArgumentError, match="mu_dtype='bf16'"):
        TrainingArguments(mu_dtype="bf16")
