"""Optimizers, each a small entry in a name -> builder registry (schedules: schedules.py).

* A run's optimizer is a ``TunableOptimizer``: its learning-rate schedule, weight decay and
  clipping norm are numbers the train step takes as an argument, so a step compiled for one
  learning rate serves every other (the betas, eps and momentum stay constants of the program).
* Weight decay is decoupled and multiplied by the scheduled lr (optax ``adamw`` style) for every
  optimizer. It applies to every parameter with ndim >= 2, embeddings included (large matrices
  that drift without it), and never to ndim < 2 ones: norm scales and biases.
* ``params``: an ``nnx.State`` of ``nnx.Param``, or any pytree of arrays or ShapeDtypeStructs
  (only shapes are read, so abstract params from ``jax.eval_shape`` work).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from jaxtrain.config.sections import OptimizerSettings
from jaxtrain.config.tables import OPTIMIZERS
from jaxtrain.training.muon import orthogonalised_momentum
from jaxtrain.training.schedules import Numbers, Schedule, build_schedule, canonical, require
from jaxtrain.training.state import abstract_arrays

# Muon scales each orthogonalised matrix update to this RMS, the typical RMS of an AdamW update
# ("Muon is Scalable for LLM Training", 2025), so one schedule serves the muon matrices and the
# Adam-handled rest of the model without a second learning rate.
MUON_CONSISTENT_RMS = 0.2


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


# ---------------------------------------------------------------------------------- optimizers


def _off(value: Any) -> bool:
    """A number that turns its part off (None or 0), known on the host: a traced value is on
    (the host decided, from its own value, to pass it)."""
    return value is None or (isinstance(value, (int, float)) and value == 0)


class _Hyper(NamedTuple):
    weight_decay: Any  # a number or a traced scalar; 0.0 leaves optax's decay out
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
        require(
            len(axes_list) == len(with_paths),
            f"logical_axes has {len(axes_list)} entries but params has {len(with_paths)} "
            "parameters; pass one axis-name tuple per parameter, in the params structure",
        )
    specs = []
    for (path, leaf), axes in zip(with_paths, axes_list):
        require(
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
    rate = None if _off(h.weight_decay) else _times_lr(lr, h.weight_decay)
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


def _check_numbers(weight_decay, clip_grad, b1, b2, eps, momentum) -> None:
    require(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
    ok_clip = clip_grad is None or clip_grad >= 0
    require(ok_clip, f"clip_grad must be None/0 (off) or a positive global norm, got {clip_grad}")
    for field, value in (("b1", b1), ("b2", b2), ("momentum", momentum)):
        require(0 <= value < 1, f"{field} must be in [0, 1), got {value}")
    require(eps > 0, f"eps must be > 0, got {eps}")


def _assemble(
    key: str, schedule: optax.ScalarOrSchedule, params: Any, hyper: _Hyper, clip_grad: Any
) -> optax.GradientTransformation:
    tx = _OPTIMIZERS[key](schedule, params, hyper)
    return tx if _off(clip_grad) else optax.chain(optax.clip_by_global_norm(clip_grad), tx)


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
    key = canonical(name, OPTIMIZERS, "optimizer")
    _check_numbers(weight_decay, clip_grad, b1, b2, eps, momentum)
    hyper = _Hyper(float(weight_decay), b1, b2, eps, momentum, logical_axes, mesh, mu_dtype)
    return _assemble(key, schedule, params, hyper, clip_grad)


def _same(tree: Any) -> Any:
    """The identity (one function, so that every placement reuses one trace)."""
    return tree


@dataclass(frozen=True)
class TunableOptimizer:
    """An optimizer as a function of its numbers: ``build(numbers) -> (optax transformation,
    schedule)``. The train step calls it on the numbers it is given (traced), so changing
    one retraces nothing and compiles nothing; `numbers` are the run's own (host) values."""

    numbers: Numbers
    build: Callable[[Numbers], tuple[optax.GradientTransformation, Any]]

    @classmethod
    def fixed(cls, optimizer: optax.GradientTransformation, schedule: Any) -> TunableOptimizer:
        """An optimizer with no numbers to swap (a user's own, from `create_optimizer`)."""
        return cls({}, lambda numbers: (optimizer, schedule))

    def __call__(self) -> tuple[optax.GradientTransformation, Any]:
        """(transformation, schedule) with the run's own numbers as constants."""
        return self.build(self.numbers)

    def abstract_numbers(self, sharding: Any = None) -> Numbers:
        """The numbers as the step traces them, weakly typed scalars (Python numbers are), for
        lowering without placing anything (a deviceless TPU plan has no device)."""

        def abstract(x: Any) -> jax.ShapeDtypeStruct:
            dtype = jnp.result_type(x)
            return jax.ShapeDtypeStruct((), dtype, weak_type=True, sharding=sharding)

        return jax.tree.map(abstract, self.numbers)

    def placed_numbers(self, sharding: Any) -> Numbers:
        """The numbers on the devices of `sharding`, weakly typed as Python numbers trace.
        Placed by a jit, not device_put: on several processes jax 0.10.2's device_put checks
        that each passed the same number, comparing a float's float64 value with the float32
        it gathered, so that 3e-4 is "not the same on each process"."""
        return jax.jit(_same, in_shardings=sharding, out_shardings=sharding)(self.numbers)

    def wrapped(
        self, wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation]
    ) -> TunableOptimizer:
        """The same numbers, the transformation wrapped (pruning's masks around it)."""

        def build(numbers: Numbers) -> tuple[optax.GradientTransformation, Any]:
            optimizer, schedule = self.build(numbers)
            return wrap(optimizer), schedule

        return TunableOptimizer(self.numbers, build)


def tunable_optimizer(
    settings: OptimizerSettings,
    total_steps: int,
    params: Any,
    logical_axes: Any = None,
    mesh: Any = None,
) -> TunableOptimizer:
    """A run's optimizer section over `total_steps` updates on `mesh` (the run's; None: one
    device), its numbers checked here. A weight decay or clipping norm of 0 is off: left out
    of the numbers, it leaves its operation out of the program."""
    schedule = build_schedule(
        settings.scheduler,
        learning_rate=settings.learning_rate,
        total_steps=total_steps,
        warmup_steps=settings.warmup_steps,
        min_lr_ratio=settings.min_lr_ratio,
        wsd_decay_fraction=settings.wsd_decay_fraction,
    )
    key = canonical(settings.optimizer, OPTIMIZERS, "optimizer")
    s = settings
    _check_numbers(
        s.weight_decay, s.clip_grad, s.adam_beta1, s.adam_beta2, s.adam_epsilon, s.momentum
    )
    # Shapes only (muon's partition reads them): the closure must not keep the arrays alive.
    params = abstract_arrays(params)
    numbers: Numbers = {"schedule": schedule.numbers}
    if not _off(s.weight_decay):
        numbers["weight_decay"] = float(s.weight_decay)
    if not _off(s.clip_grad):
        numbers["clip_grad"] = float(s.clip_grad)

    def build(numbers: Numbers) -> tuple[optax.GradientTransformation, Schedule]:
        rate = schedule.with_numbers(numbers["schedule"])
        hyper = _Hyper(
            numbers.get("weight_decay", 0.0),
            s.adam_beta1,
            s.adam_beta2,
            s.adam_epsilon,
            s.momentum,
            logical_axes,
            mesh,
            s.mu_dtype,
        )
        return _assemble(key, rate, params, hyper, numbers.get("clip_grad")), rate

    return TunableOptimizer(numbers, build)


def run_optimizer(
    settings: OptimizerSettings,
    total_steps: int,
    params: Any,
    logical_axes: Any = None,
    mesh: Any = None,
) -> tuple[optax.GradientTransformation, Schedule]:
    """(optax transformation, learning-rate schedule) of a run's optimizer section, its
    numbers as constants (`tunable_optimizer` with the run's own numbers)."""
    return tunable_optimizer(settings, total_steps, params, logical_axes, mesh)()
