"""LoRA (Hu et al. 2021): low-rank adapters on the projections of a model.

A targeted `Projection` y = x W gains y += (x A) B * alpha / rank, A [in..., r] (random) and
B [r, out...] (zeros, so training starts from the base model). `apply_lora` turns every other
nnx.Param of the model into a `Frozen` variable, so the Trainer trains and checkpoints the
adapters alone, and passes the frozen base to the compiled step as a sharded argument.
A and B carry the kernel's logical axes on their in/out dims, so they shard like it.

Targets (`lora_targets`) name what to adapt:
- a group: "attention" (Llama family: qkv_proj, o_proj; GPT-2: attn.c_attn, attn.c_proj;
  ViT: qkv, out) or "mlp" (gate_up_proj, down_proj; mlp.c_fc, mlp.c_proj; fc1, fc2);
- a projection, by the end of its attribute path as PEFT matches module names ("c_proj" is
  both of GPT-2's, "mlp.c_proj" one): one adapter on the whole kernel, fused or not;
- a part of a fused kernel, by its Hugging Face name: q_proj, k_proj, v_proj (qkv_proj),
  gate_proj, up_proj (gate_up_proj), query, key, value (ViT's qkv). As in PEFT, each targeted
  part gets its own A [in..., r] and B [r, part outputs], and its delta lands on its slice of
  the fused output axis (zeros elsewhere): "q_proj,v_proj" leaves k untouched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.config.tables import (
    FUSED_PART_NAMES,
    LORA_GROUPS,
    LORA_TARGETS,
    resolve_lora_targets,
)
from jaxtrain.errors import ArgumentError
from jaxtrain.models.frozen import Frozen, freeze, unfreeze
from jaxtrain.models.layers import Projection

logger = logging.getLogger(__name__)

__all__ = [
    "FUSED_PARTS",
    "LORA_GROUPS",
    "LORA_TARGETS",
    "FusedLoRA",
    "LoRA",
    "adapters_off",
    "apply_lora",
    "default_targets",
    "has_experts",
    "has_lora",
    "lora_projections",
    "merge_lora",
    "part_slices",
    "resolve_targets",
    "set_lora_dropout_key",
]

# Each fused projection's parts and the logical name of the axis they lie along. Three parts
# on an axis of size S: [0, S-2), S-2, S-1 (a Llama kv-group holds its G query heads, then k,
# then v; GPT-2 and ViT have S = 3).
FUSED_AXES = {"qkv_proj": "qkv", "gate_up_proj": "gate_up", "qkv": "qkv"}
FUSED_PARTS: dict[str, tuple[str, tuple[str, ...]]] = {
    fused: (FUSED_AXES[fused], parts) for fused, parts in FUSED_PART_NAMES.items()
}
_PART_OF = {part: fused for fused, (_, parts) in FUSED_PARTS.items() for part in parts}
resolve_targets = resolve_lora_targets


def _kernel_shape_dtype(kernel: Any) -> tuple[tuple[int, ...], Any]:
    """A kernel's shape and float dtype; a quantized one's without dequantizing it."""
    if getattr(kernel, "is_quantized", False):
        return tuple(kernel.shape), jnp.dtype(kernel.value_dtype)
    value = kernel[...]
    return tuple(value.shape), value.dtype


def part_slices(base: Projection, fused: str) -> dict[str, tuple[int, int, int]]:
    """name -> (kernel axis, start, stop) of each part of the fused projection `base`."""
    axis_name, names = FUSED_PARTS[fused]
    axes = tuple(base.kernel.get_metadata().get("logical_axes") or ())
    if axis_name not in axes:
        raise ValueError(f"{fused}: its kernel has no {axis_name!r} axis to split into {names}")
    axis = axes.index(axis_name)
    size = _kernel_shape_dtype(base.kernel)[0][axis]
    if len(names) == 3:
        bounds = [(0, size - 2), (size - 2, size - 1), (size - 1, size)]
    else:
        bounds = [(i * size // len(names), (i + 1) * size // len(names)) for i in range(len(names))]
    return {n: (axis, start, stop) for n, (start, stop) in zip(names, bounds)}


class LoRA(nnx.Module):
    """The adapter of one Projection: ``delta(x) = dropout(x) A B * alpha / rank``; with
    `part` = (kernel axis, start, stop), of that slice of the kernel's outputs only."""

    def __init__(
        self,
        base: Projection,
        *,
        rank: int,
        alpha: float,
        dropout: float,
        key: Any,
        part: tuple[int, int, int] | None = None,
    ):
        x_spec, k_spec = base.equation.split("->")[0].split(",")
        out_spec = base.equation.split("->")[1]
        axes = base.kernel.get_metadata().get("logical_axes") or (None,) * len(k_spec)
        shape, dtype = _kernel_shape_dtype(base.kernel)
        shape = list(shape)
        self.part = None
        if part is not None:
            axis, start, stop = part
            if k_spec[axis] in x_spec:
                raise ValueError(f"LoRA part on kernel axis {axis}, an input axis")
            # (kernel axis, output axis, start, stop, full size): where the delta lands
            self.part = (axis, out_spec.index(k_spec[axis]), start, stop, shape[axis])
            shape[axis] = stop - start
        ins = [i for i, c in enumerate(k_spec) if c in x_spec]
        outs = [i for i, c in enumerate(k_spec) if c not in x_spec]
        batch = "".join(c for c in x_spec if c not in k_spec)
        in_letters = "".join(k_spec[i] for i in ins)
        out_letters = "".join(k_spec[i] for i in outs)
        self.eq_a = f"{x_spec},{in_letters}r->{batch}r"
        self.eq_b = f"{batch}r,r{out_letters}->{out_spec}"
        self.eq_delta = f"{in_letters}r,r{out_letters}->{k_spec}"
        fan_in = 1
        for i in ins:
            fan_in *= shape[i]
        a = jax.random.normal(key, (*(shape[i] for i in ins), rank)) / jnp.sqrt(fan_in)
        self.a = nnx.Param(a.astype(dtype), logical_axes=(*(axes[i] for i in ins), None))
        self.b = nnx.Param(
            jnp.zeros((rank, *(shape[i] for i in outs)), dtype),
            logical_axes=(None, *(axes[i] for i in outs)),
        )
        self.rank, self.alpha, self.dropout = rank, float(alpha), float(dropout)
        self.scale = self.alpha / rank
        self.dtype = base.dtype
        self.dropout_key = None  # set inside a train step only (set_lora_dropout_key)

    def _place(self, y: jax.Array, axis: int) -> jax.Array:
        """`y` (this part's slice) zero-padded to the fused axis' full size."""
        if self.part is None:
            return y
        _, _, start, stop, full = self.part
        pad = [(0, 0)] * y.ndim
        pad[axis] = (start, full - stop)
        return jnp.pad(y, pad)

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        key = self.dropout_key if dropout_key is None else dropout_key
        x = x.astype(self.dtype)
        if self.dropout > 0 and key is not None:
            keep = jax.random.bernoulli(key, 1 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1 - self.dropout), 0).astype(self.dtype)
        xa = jnp.einsum(self.eq_a, x, self.a[...].astype(self.dtype))
        y = jnp.einsum(self.eq_b, xa, self.b[...].astype(self.dtype)) * self.scale
        return y if self.part is None else self._place(y, self.part[1])

    def delta(self) -> jax.Array:
        """The kernel update A B * alpha / rank, in the kernel's layout (float32)."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        d = jnp.einsum(self.eq_delta, a, b) * self.scale
        return d if self.part is None else self._place(d, self.part[0])


class FusedLoRA(nnx.Module):
    """Adapters on some parts of a fused projection (PEFT's one A and one B per targeted
    module): ``parts`` maps each part's Hugging Face name to its LoRA."""

    def __init__(
        self,
        base: Projection,
        slices: dict[str, tuple[int, int, int]],
        *,
        rank: int,
        alpha: float,
        dropout: float,
        key: Any,
    ):
        self.parts = nnx.Dict(
            {
                name: LoRA(
                    base,
                    rank=rank,
                    alpha=alpha,
                    dropout=dropout,
                    key=jax.random.fold_in(key, i),
                    part=part,
                )  # fmt: skip
                for i, (name, part) in enumerate(slices.items())
            }
        )
        self.rank, self.alpha, self.dropout = rank, float(alpha), float(dropout)
        self.scale = self.alpha / rank
        self.dropout_key = None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = None
        for i, lora in enumerate(self.parts.values()):
            key = None if self.dropout_key is None else jax.random.fold_in(self.dropout_key, i)
            out = lora(x, dropout_key=key)
            y = out if y is None else y + out
        return y

    def delta(self) -> jax.Array:
        return sum(lora.delta() for lora in self.parts.values())


def lora_projections(model: nnx.Module) -> list[tuple[tuple[Any, ...], Projection]]:
    """(path, projection) of every Projection that carries an adapter."""
    return [
        (path, m)
        for path, m in nnx.iter_modules(model)
        if isinstance(m, Projection) and getattr(m, "lora", None) is not None
    ]


def has_lora(model: nnx.Module) -> bool:
    return bool(lora_projections(model))


def _matches(path: tuple[Any, ...], name: str) -> bool:
    """PEFT-style: `name` ("c_proj", "mlp.c_proj") is the end of the module's path."""
    parts = name.split(".")
    return len(path) >= len(parts) and [str(p) for p in path[-len(parts) :]] == parts


def _plan(model: nnx.Module, names: Sequence[str]) -> tuple[list, set[str]]:
    """[(projection, part slices or None)] to adapt, and the names that matched something."""
    plan, used = [], set()
    # The frozen models a task reads (TaskModel.frozen_names: a reference, a teacher) take
    # no adapter, a quantized one neither (its kernels are not Params, like the base's), nor
    # what a model keeps out of LoRA (`lora_skip`: a vision-language model's image encoder).
    frozen = {
        id(sub)
        for _, m in nnx.iter_modules(model)
        for name in (*getattr(m, "frozen_names", ()), *getattr(m, "lora_skip", ()))
        if getattr(m, name, None) is not None
        for _, sub in nnx.iter_modules(getattr(m, name))
    }
    for path, m in nnx.iter_modules(model):
        if not isinstance(m, Projection) or not path or id(m) in frozen:
            continue
        if not (isinstance(m.kernel, nnx.Param) or getattr(m.kernel, "is_quantized", False)):
            continue
        if getattr(m, "lora", None) is not None:
            continue
        whole = [n for n in names if n not in _PART_OF and _matches(path, n)]
        parts = [n for n in names if _PART_OF.get(n) == str(path[-1])]
        if whole:
            used.update(whole)
            used.update(parts)  # covered by the whole-kernel adapter
            plan.append((m, None))
        elif parts:
            slices = part_slices(m, str(path[-1]))
            used.update(parts)
            plan.append((m, {n: s for n, s in slices.items() if n in parts}))
    return plan, used


def has_experts(model: nnx.Module) -> bool:
    """Whether `model` holds mixture-of-experts weights (a Param with the `expert` axis)."""
    return any(
        "expert" in (getattr(v, "logical_axes", None) or ())
        for _, v in nnx.iter_graph(model)
        if isinstance(v, nnx.Param)
    )


def default_targets(model: nnx.Module) -> list[str]:
    """What `lora_targets=None` adapts: the groups "attention" and "mlp" that the model has.

    A mixture-of-experts model's experts take no adapter (their weights are stacked
    [experts, ...] arrays run by the grouped matmul, not projections), so its "mlp" is only
    the MLPs outside the experts (a shared expert, dense layers) and is left out when it
    has none: the default of such a model is "attention"."""
    names = resolve_targets(list(LORA_GROUPS))
    _, used = _plan(model, names)
    return [group for group, members in LORA_GROUPS.items() if set(members) & used]


def _available(model: nnx.Module) -> list[str]:
    """Every target that names something of `model`: its groups, projections and parts."""
    present = set(default_targets(model))
    for p, m in nnx.iter_modules(model):
        if isinstance(m, Projection) and p and str(p[-1]) in LORA_TARGETS:
            present.add(str(p[-1]))
            present.update(FUSED_PARTS.get(str(p[-1]), ("", ()))[1])
    return sorted(present)


def apply_lora(
    model: nnx.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: Sequence[str] | None = None,
    seed: int = 0,
) -> nnx.Module:
    """Add adapters to the targeted projections of `model` and freeze everything else,
    in place; returns `model`. `targets` None: `default_targets(model)`. Modules listing
    attribute names in `lora_keep` (a reward model's score head, a classifier) keep those
    trainable. ArgumentError when a target names nothing of this model."""
    if targets is None:
        targets = default_targets(model)
        if has_experts(model):
            logger.warning(
                "jaxtrain: LoRA on a mixture-of-experts model: expert weights take no adapter; "
                "adapting %s (lora_targets).",
                targets,
            )
    try:
        names = resolve_targets(targets)
    except ValueError as err:
        raise ArgumentError(f"TrainingArguments.{err}") from None
    plan, used = _plan(model, names)
    groups = {t: LORA_GROUPS[t] for t in targets if t in LORA_GROUPS}
    missing = [t for t in targets if not (set(groups[t]) & used if t in groups else t in used)]
    if missing or not plan:
        experts = (
            " (expert weights of a mixture-of-experts model take no adapter)"
            if has_experts(model)
            else ""
        )
        raise ArgumentError(
            f"TrainingArguments.lora_targets {list(targets)!r}: {missing or list(targets)!r} "
            f"match no trainable projection of {type(model).__name__}{experts}; targets "
            f"that do: {_available(model)}, e.g. --lora_targets "
            f"{','.join(default_targets(model)) or 'o_proj'}."
        )
    keep = {}
    for _, m in nnx.iter_modules(model):
        for name in getattr(m, "lora_keep", ()):
            keep[(id(m), name)] = getattr(m, name)
    freeze(model)
    for (m_id, name), kept in keep.items():  # restore the kept Params / modules
        if isinstance(kept, nnx.Module):
            unfreeze(kept)
            continue
        for _, m in nnx.iter_modules(model):
            if id(m) == m_id:
                setattr(m, name, kept)
    key = jax.random.key(seed)
    kw = dict(rank=rank, alpha=alpha, dropout=dropout)
    for i, (projection, slices) in enumerate(plan):
        k = jax.random.fold_in(key, i)
        projection.lora = (
            LoRA(projection, key=k, **kw)
            if slices is None
            else FusedLoRA(projection, slices, key=k, **kw)
        )
    return model


def set_lora_dropout_key(model: nnx.Module, key: jax.Array) -> None:
    """Give every adapter its dropout key for this (traced) step."""
    for i, (_, projection) in enumerate(lora_projections(model)):
        if projection.lora.dropout > 0:
            projection.lora.dropout_key = jax.random.fold_in(key, i)


def merge_lora(model: nnx.Module) -> nnx.Module:
    """A copy of `model` with every adapter folded into its kernel and every weight an
    nnx.Param again: a plain model (what an HF export writes)."""
    merged = nnx.clone(model)
    for _, projection in lora_projections(merged):
        kernel = projection.kernel[...]
        new = (kernel.astype(jnp.float32) + projection.lora.delta()).astype(kernel.dtype)
        projection.kernel = Frozen(new, **projection.kernel.get_metadata())
        projection.lora = None
    return unfreeze(merged)


@contextlib.contextmanager
def adapters_off(model: nnx.Module):
    """`model` without its LoRA adapters while inside (traced: the base weights alone)."""
    saved = [(m, m.lora) for _, m in lora_projections(model)]
    for m, _ in saved:
        m.lora = None
    try:
        yield model
    finally:
        for m, lora in saved:
            m.lora = lora
