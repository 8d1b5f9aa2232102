"""Learning-rate schedules and optimizers, each a small entry in a name -> builder registry.

* Steps count optimizer updates (optax's ``count``); the first update is step 0.
* Warmup never wastes an update: step ``s < W`` (W = warmup_steps) uses ``lr * (s + 1) / W``, so
  step 0 gives ``lr / W`` (not 0) and step ``W - 1`` the peak. Decay starts at step W and reaches
  ``min_lr_ratio * lr`` at step ``total_steps``.
* Weight decay is decoupled and multiplied by the scheduled lr (optax ``adamw`` style) for every
  optimizer. It applies to every parameter with ndim >= 2, embeddings included (large matrices
  that drift without it), and never to ndim < 2 ones: norm scales and biases.
* ``params``: an ``nnx.State`` of ``nnx.Param``, or any pytree of arrays or ShapeDtypeStructs
  (only shapes are read, so abstract params from ``jax.eval_shape`` work).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from jaxtrain.config.sections import OptimizerSettings
from jaxtrain.config.tables import OPTIMIZERS, SCHEDULERS
from jaxtrain.training.muon import orthogonalised_momentum

# Muon scales each orthogonalised matrix update to this RMS, the typical RMS of an AdamW update
# ("Muon is Scalable for LLM Training", 2025), so one schedule serves the muon matrices and the
# Adam-handled rest of the model without a second learning rate.
MUON_CONSISTENT_RMS = 0.2


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _canonical(name: Any, valid: tuple[str, ...], kind: str) -> str:
    key = name.strip().lower().replace("-", "_") if isinstance(name, str) else None
    _require(key in valid, f"unknown {kind} {name!r}; valid names: {', '.join(valid)}")
    return key


# ----------------------------------------------------------------------------------- schedules


class _Plan(NamedTuple):
    peak: float
    floor: float  # min_lr_ratio * peak
    min_lr_ratio: float
    total_steps: int
    decay_steps: int  # from the end of warmup to total_steps
    wsd_decay_fraction: float


def _wsd(p: _Plan) -> optax.Schedule:
    decay = max(1, round(p.wsd_decay_fraction * p.total_steps))
    stable, warmup = p.decay_steps - decay, p.total_steps - p.decay_steps
    _require(
        stable >= 0,
        f"wsd: warmup_steps ({warmup}) + decay steps ({decay} = wsd_decay_fraction * "
        f"total_steps) exceed total_steps ({p.total_steps}); lower warmup_steps or the fraction",
    )
    decay_part = optax.linear_schedule(p.peak, p.floor, decay)
    return optax.join_schedules([optax.constant_schedule(p.peak), decay_part], [stable])


# name -> the schedule after warmup
_SCHEDULES: dict[str, Callable[[_Plan], optax.Schedule]] = {
    "constant": lambda p: optax.constant_schedule(p.peak),
    "linear": lambda p: optax.linear_schedule(p.peak, p.floor, p.decay_steps),
    "cosine": lambda p: optax.cosine_decay_schedule(p.peak, p.decay_steps, p.min_lr_ratio),
    "warmup_cosine": lambda p: _SCHEDULES["cosine"](p),
    "wsd": _wsd,
}


def build_schedule(
    name: str,
    *,
    learning_rate: float,
    total_steps: int,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.0,
    wsd_decay_fraction: float = 0.1,
) -> optax.Schedule:
    """Return ``step -> learning rate`` for one of ``SCHEDULERS`` (see the module docstring)."""
    key = _canonical(name, SCHEDULERS, "scheduler")
    ok_total = isinstance(total_steps, int) and total_steps > 0
    _require(ok_total, f"total_steps must be an int > 0 (optimizer updates), got {total_steps!r}")
    ok_warmup = isinstance(warmup_steps, int) and warmup_steps >= 0
    _require(ok_warmup, f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    ok_lr = math.isfinite(learning_rate) and learning_rate >= 0
    _require(ok_lr, f"learning_rate must be a finite number >= 0, got {learning_rate!r}")
    _require(0 <= min_lr_ratio <= 1, f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    ok_fraction = 0 < wsd_decay_fraction <= 1
    _require(ok_fraction, f"wsd_decay_fraction must be in (0, 1], got {wsd_decay_fraction}")
    _require(
        key != "warmup_cosine" or warmup_steps > 0,
        "warmup_cosine needs warmup_steps > 0; set warmup_steps or use 'cosine'",
    )
    _require(
        key == "constant" or warmup_steps < total_steps,
        f"{key}: warmup_steps ({warmup_steps}) must be < total_steps ({total_steps}) to leave "
        "steps to decay; lower warmup_steps or raise total_steps",
    )
    peak = float(learning_rate)
    decay_steps = total_steps - warmup_steps
    plan = _Plan(
        peak, peak * min_lr_ratio, min_lr_ratio, total_steps, decay_steps, wsd_decay_fraction
    )
    main = _SCHEDULES[key](plan)
    if warmup_steps == 0:
        return main
    # (s + 1) / W ramp: from lr/W at step 0 to lr at step W - 1 (W = 1 is flat at lr).
    ramp = optax.linear_schedule(peak / warmup_steps, peak, max(warmup_steps - 1, 1))
    return optax.join_schedules([ramp, main], [warmup_steps])


def learning_rate_at(schedule: optax.ScalarOrSchedule, step: int) -> float:
    """The learning rate used by update ``step`` (for logging)."""
    return float(schedule(step)) if callable(schedule) else float(schedule)


# ---------------------------------------------------------------------------------- optimizers


class _Hyper(NamedTuple):
    weight_decay: float
    b1: float
    b2: float
    eps: float
    momentum: float
    logical_axes: Any
    mesh: Any  # Muon spreads its matrices over the mesh's devices (training/muon.py)
    mu_dtype: Any = None  # the first moment's (momentum's) dtype; None: the parameters'


def _decay_mask(tree: Any) -> Any:
    """True for ndim >= 2 leaves. A callable, so it also fits the partial trees optax masks."""

    def decayed(x: Any) -> bool:
        value = x.get_value() if _is_variable(x) else x
        # Inside optax.partition the other branch's leaves are MaskedNodes: not decayed here.
        return not isinstance(value, optax.MaskedNode) and len(value.shape) >= 2

    return jax.tree.map(decayed, tree, is_leaf=_is_variable)


def _times_lr(lr: optax.ScalarOrSchedule, factor: float) -> optax.ScalarOrSchedule:
    return (lambda step: factor * lr(step)) if callable(lr) else factor * lr


def _is_axes(x: Any) -> bool:
    names = isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
    return x is None or names or _is_variable(x)


def _muon_spec(shape: tuple[int, ...], axes: tuple | None) -> MuonDimensionNumbers | None:
    """Orthogonalised as (input features, output features) matrices, or None: AdamW."""
    ndim = len(shape)
    if ndim < 2:
        return None  # norm scales and biases
    if axes is None:
        return MuonDimensionNumbers(reduction_axis=0, output_axis=1) if ndim == 2 else None
    if "vocab" in axes:
        return None  # the token embedding and the LM head
    if axes[0] == "expert" and ndim >= 3:  # stacked experts: one matrix per expert
        inner = _muon_spec(shape[1:], axes[1:])
        if inner is None:
            return None
        shift = lambda a: tuple(i + 1 for i in a) if isinstance(a, tuple) else a + 1  # noqa: E731
        return MuonDimensionNumbers(shift(inner.reduction_axis), shift(inner.output_axis))
    if axes[0] is None or axes[-1] is None:
        # An unnamed input axis is not a hidden feature (a position table, a patch
        # projection); an unnamed output axis is a head (a reward score, a classifier, the
        # MoE router's logits): the model's inputs and outputs, which Muon leaves to AdamW.
        return None
    if axes[0] == "embed":  # x @ W: reduce over the input features
        return MuonDimensionNumbers(reduction_axis=0, output_axis=tuple(range(1, ndim)))
    if axes[-1] == "embed":  # fused inputs (heads, head_dim) -> embed
        return MuonDimensionNumbers(reduction_axis=tuple(range(ndim - 1)), output_axis=ndim - 1)
    return MuonDimensionNumbers(reduction_axis=0, output_axis=1) if ndim == 2 else None


def muon_dimension_numbers(params: Any, logical_axes: Any = None) -> Any:
    """A prefix tree of ``params``: per parameter ``MuonDimensionNumbers`` (orthogonalised) or
    None (AdamW). ``logical_axes``: axis-name tuples matching ``params``; when None, each
    ``nnx.Variable``'s own ``logical_axes`` metadata, and without either, 2-D means matrix.

    The rules, as Muon prescribes (only the hidden layers' matrices): ndim < 2 (norms,
    biases), any "vocab" axis (token embedding, LM head), an unnamed first axis (a position
    table, a patch projection) or last axis (a reward or classification head, the MoE
    router) -> AdamW; first axis "embed" -> reduce axis 0, output the rest; last axis "embed"
    -> reduce the others, output the last; a leading "expert" axis -> one matrix per expert
    by the same rules. A fused kernel (qkv, gate_up) is orthogonalised as one matrix.
    """
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)
    if logical_axes is None:
        axes_list = [getattr(leaf, "logical_axes", None) for _, leaf in with_paths]
    else:
        axes_list = jax.tree.leaves(logical_axes, is_leaf=_is_axes)
        axes_list = [a.get_value() if _is_variable(a) else a for a in axes_list]
        _require(
            len(axes_list) == len(with_paths),
            f"logical_axes has {len(axes_list)} entries but params has {len(with_paths)} "
            "parameters; pass one axis-name tuple per parameter, in the params structure",
        )
    specs = []
    for (path, leaf), axes in zip(with_paths, axes_list):
        _require(
            axes is None or len(axes) == len(leaf.shape),
            f"logical_axes{jax.tree_util.keystr(path)} = {axes} does not match the parameter "
            f"shape {tuple(leaf.shape)}; give one name (or None) per dimension",
        )
        specs.append(_muon_spec(tuple(leaf.shape), axes))
    return treedef.unflatten(specs)


def _adamw(lr: optax.ScalarOrSchedule, params: Any, h: _Hyper) -> optax.GradientTransformation:
    return optax.adamw(
        lr, h.b1, h.b2, h.eps, weight_decay=h.weight_decay, mask=_decay_mask, mu_dtype=h.mu_dtype
    )


def _lion(lr: optax.ScalarOrSchedule, params: Any, h: _Hyper) -> optax.GradientTransformation:
    # b1/b2 are passed through as given; the Lion paper uses b2=0.99.
    return optax.lion(
        lr, h.b1, h.b2, weight_decay=h.weight_decay, mask=_decay_mask, mu_dtype=h.mu_dtype
    )


def _sgd(lr: optax.ScalarOrSchedule, params: Any, h: _Hyper) -> optax.GradientTransformation:
    # Decay after the momentum trace, so it is decoupled from the momentum buffer.
    trace = (
        optax.trace(decay=h.momentum, nesterov=False, accumulator_dtype=h.mu_dtype)
        if h.momentum
        else optax.identity()
    )
    decay = optax.add_decayed_weights(h.weight_decay, mask=_decay_mask)
    return optax.chain(trace, decay, optax.scale_by_learning_rate(lr))


def _adafactor(lr: optax.ScalarOrSchedule, params: Any, h: _Hyper) -> optax.GradientTransformation:
    # Absolute step sizes like adamw (no parameter scaling); optax adds the decay after the lr
    # scaling, so the rate follows the schedule. b1/b2/eps are Adam knobs, unused here.
    rate = _times_lr(lr, h.weight_decay) if h.weight_decay else None
    return optax.adafactor(
        lr, multiply_by_parameter_scale=False, weight_decay_rate=rate, weight_decay_mask=_decay_mask
    )


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


def _fan_in_out(shape: tuple[int, ...], spec: MuonDimensionNumbers) -> tuple[int, int]:
    axes = lambda a: a if isinstance(a, tuple) else (a,)  # noqa: E731
    fan_in = math.prod(shape[i] for i in axes(spec.reduction_axis))
    return fan_in, math.prod(shape[i] for i in axes(spec.output_axis))


def _consistent_rms(specs: Callable[[Any], Any]) -> optax.GradientTransformation:
    """Each orthogonalised update times sqrt(max(fan_in, fan_out)) * MUON_CONSISTENT_RMS: the
    RMS of an AdamW update ("Muon is Scalable for LLM Training", 2025)."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        def scale(u: Any, spec: MuonDimensionNumbers) -> Any:
            fan_in, fan_out = _fan_in_out(u.shape, spec)
            return u * (math.sqrt(max(fan_in, fan_out)) * MUON_CONSISTENT_RMS)

        masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
        return jax.tree.map(
            lambda spec, u: u if masked(spec) else scale(u, spec),
            specs(updates),
            updates,
            is_leaf=lambda x: _is_spec(x) or masked(x),
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _muon(lr: optax.ScalarOrSchedule, params: Any, h: _Hyper) -> optax.GradientTransformation:
    """Muon (Nesterov momentum orthogonalised by Newton-Schulz, each matrix whole on one
    device: training/muon.py) for the hidden matrices, AdamW for the rest (embeddings,
    heads, norms, biases), as the method prescribes; both follow the one schedule (the
    consistent-RMS scaling)."""
    specs = muon_dimension_numbers(params, h.logical_axes)
    labels = jax.tree.map(
        lambda spec, sub: jax.tree.map(lambda _: "adamw" if spec is None else "muon", sub),
        specs,
        params,
        is_leaf=_is_spec,
    )

    def muon_specs(tree: Any) -> Any:
        """The dimension numbers of the tree the muon branch sees (AdamW's leaves masked)."""
        masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
        return jax.tree.map(
            lambda spec, sub: jax.tree.map(lambda x: x if masked(x) else spec, sub, is_leaf=masked),
            specs,
            tree,
            is_leaf=_is_spec,
        )

    muon = optax.chain(
        orthogonalised_momentum(
            muon_specs, beta=h.momentum, eps=h.eps, mesh=h.mesh, mu_dtype=h.mu_dtype
        ),
        _consistent_rms(muon_specs),
        optax.add_decayed_weights(h.weight_decay),  # decoupled, x the scheduled lr below
        optax.scale_by_learning_rate(lr),
    )
    return optax.partition({"muon": muon, "adamw": _adamw(lr, params, h)}, labels)


_OPTIMIZERS: dict[str, Callable[[Any, Any, _Hyper], optax.GradientTransformation]] = {
    "adamw": _adamw,
    "adafactor": _adafactor,
    "lion": _lion,
    "sgd": _sgd,
    "muon": _muon,
}


def build_optimizer(
    name: str,
    schedule: optax.ScalarOrSchedule,
    params: Any,
    *,
    weight_decay: float = 0.0,
    clip_grad: float | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    momentum: float = 0.9,
    logical_axes: Any = None,
    mesh: Any = None,
    mu_dtype: str | None = None,
) -> optax.GradientTransformation:
    """Build one of ``OPTIMIZERS`` for ``params``; ``clip_grad`` (global norm) runs first.

    ``momentum`` is SGD's momentum and Muon's ``beta``; ``b1``/``b2``/``eps`` drive AdamW, Lion
    (b1, b2) and Muon's AdamW branch. ``logical_axes`` and ``mesh`` (the run's, over whose
    devices Muon spreads its matrices) only matter for muon. ``mu_dtype``: the dtype AdamW's
    first moment, Lion's, SGD's and Muon's momentum are kept in (computed in float32;
    adafactor keeps none); None: the parameters'.
    """
    key = _canonical(name, OPTIMIZERS, "optimizer")
    _require(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
    ok_clip = clip_grad is None or clip_grad >= 0
    _require(ok_clip, f"clip_grad must be None/0 (off) or a positive global norm, got {clip_grad}")
    for field, value in (("b1", b1), ("b2", b2), ("momentum", momentum)):
        _require(0 <= value < 1, f"{field} must be in [0, 1), got {value}")
    _require(eps > 0, f"eps must be > 0, got {eps}")
    hyper = _Hyper(float(weight_decay), b1, b2, eps, momentum, logical_axes, mesh, mu_dtype)
    tx = _OPTIMIZERS[key](schedule, params, hyper)
    if clip_grad:
        tx = optax.chain(optax.clip_by_global_norm(clip_grad), tx)
    return tx


def run_optimizer(
    settings: OptimizerSettings,
    total_steps: int,
    params: Any,
    logical_axes: Any = None,
    mesh: Any = None,
) -> tuple[optax.GradientTransformation, Callable[[Any], Any]]:
    """(optax transformation, learning-rate schedule) of a run's optimizer section over
    `total_steps` updates on `mesh` (the run's; None: one device)."""
    schedule = build_schedule(
        settings.scheduler,
        learning_rate=settings.learning_rate,
        total_steps=total_steps,
        warmup_steps=settings.warmup_steps,
        min_lr_ratio=settings.min_lr_ratio,
        wsd_decay_fraction=settings.wsd_decay_fraction,
    )
    optimizer = build_optimizer(
        settings.optimizer,
        schedule,
        params,
        weight_decay=settings.weight_decay,
        clip_grad=settings.clip_grad,
        b1=settings.adam_beta1,
        b2=settings.adam_beta2,
        eps=settings.adam_epsilon,
        momentum=settings.momentum,
        logical_axes=logical_axes,
        mesh=mesh,
        mu_dtype=settings.mu_dtype,
    )
    return optimizer, schedule
