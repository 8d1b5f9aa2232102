"""LoRA (Hu et al. 2021): low-rank adapters on the projections of a model.

A targeted `Projection` y = x W gains y += (x A) B * alpha / rank, A [in..., r] (random) and
B [r, out...] (zeros, so training starts from the base model). `apply_lora` turns every other
nnx.Param of the model into a `Frozen` variable, so the Trainer trains and checkpoints the
adapters alone, and passes the frozen base to the compiled step as a sharded argument.
A and B carry the kernel's logical axes on their in/out dims, so they shard like it.

Targets are logical names: "attention" (qkv_proj, o_proj), "mlp" (gate_up_proj, down_proj),
a projection's own name, or the Hugging Face names (q_proj, k_proj, v_proj -> qkv_proj;
gate_proj, up_proj -> gate_up_proj).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.models.frozen import Frozen, freeze, unfreeze
from jaxtrain.models.layers import Projection

__all__ = [
    "LORA_TARGETS",
    "LoRA",
    "apply_lora",
    "has_lora",
    "lora_projections",
    "merge_lora",
    "resolve_targets",
    "set_lora_dropout_key",
]

LORA_TARGETS = {
    "attention": ("qkv_proj", "o_proj"),
    "mlp": ("gate_up_proj", "down_proj"),
    "qkv_proj": ("qkv_proj",),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_up_proj",),
    "down_proj": ("down_proj",),
    "q_proj": ("qkv_proj",),
    "k_proj": ("qkv_proj",),
    "v_proj": ("qkv_proj",),
    "gate_proj": ("gate_up_proj",),
    "up_proj": ("gate_up_proj",),
}


def resolve_targets(targets: Sequence[str]) -> tuple[str, ...]:
    """Projection attribute names of the logical `targets`; ValueError naming unknown ones."""
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise ValueError(
            f"lora_targets {list(targets)!r}: unknown {unknown!r}; use some of "
            f"{sorted(LORA_TARGETS)}"
        )
    return tuple(dict.fromkeys(n for t in targets for n in LORA_TARGETS[t]))


class LoRA(nnx.Module):
    """The adapter of one Projection: ``delta(x) = dropout(x) A B * alpha / rank``."""

    def __init__(self, base: Projection, *, rank: int, alpha: float, dropout: float, key: Any):
        x_spec, k_spec = base.equation.split("->")[0].split(",")
        out_spec = base.equation.split("->")[1]
        axes = base.kernel.get_metadata().get("logical_axes") or (None,) * len(k_spec)
        shape = base.kernel[...].shape
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
        dtype = base.kernel[...].dtype
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

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        if self.dropout > 0 and self.dropout_key is not None:
            keep = jax.random.bernoulli(self.dropout_key, 1 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1 - self.dropout), 0).astype(self.dtype)
        xa = jnp.einsum(self.eq_a, x, self.a[...].astype(self.dtype))
        return jnp.einsum(self.eq_b, xa, self.b[...].astype(self.dtype)) * self.scale

    def delta(self) -> jax.Array:
        """The kernel update A B * alpha / rank, in the kernel's layout (float32)."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        return jnp.einsum(self.eq_delta, a, b) * self.scale


def lora_projections(model: nnx.Module) -> list[tuple[tuple[Any, ...], Projection]]:
    """(path, projection) of every Projection that carries an adapter."""
    return [
        (path, m)
        for path, m in nnx.iter_modules(model)
        if isinstance(m, Projection) and getattr(m, "lora", None) is not None
    ]


def has_lora(model: nnx.Module) -> bool:
    return bool(lora_projections(model))


def apply_lora(
    model: nnx.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    targets: Sequence[str] = ("attention", "mlp"),
    seed: int = 0,
) -> nnx.Module:
    """Add adapters to the targeted projections of `model` and freeze everything else,
    in place; returns `model`. Modules listing attribute names in `lora_keep` (a reward
    model's score head) keep those trainable."""
    names = resolve_targets(targets)
    chosen = [
        (path, m)
        for path, m in nnx.iter_modules(model)
        if isinstance(m, Projection)
        and path
        and path[-1] in names
        and isinstance(m.kernel, nnx.Param)
        and getattr(m, "lora", None) is None
    ]
    if not chosen:
        raise ValueError(
            f"lora_targets {list(targets)!r} match no trainable projection of "
            f"{type(model).__name__} (projections: qkv_proj, o_proj, gate_up_proj, down_proj)"
        )
    keep = {}
    for _, m in nnx.iter_modules(model):
        for name in getattr(m, "lora_keep", ()):
            keep[(id(m), name)] = getattr(m, name)
    freeze(model)
    for (m_id, name), var in keep.items():  # restore the kept Params
        for _, m in nnx.iter_modules(model):
            if id(m) == m_id:
                setattr(m, name, var)
    key = jax.random.key(seed)
    for i, (_, projection) in enumerate(chosen):
        projection.lora = LoRA(
            projection, rank=rank, alpha=alpha, dropout=dropout, key=jax.random.fold_in(key, i)
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
