"""Frozen weights: a Variable type that is not an nnx.Param (see jaxtrain.trainers.frozen).

The Trainer trains the model's nnx.Param variables and passes everything else to the compiled
step as a sharded argument; `Frozen` weights keep their `logical_axes` for the rules.
"""

from __future__ import annotations

from flax import nnx

__all__ = ["Frozen", "freeze", "unfreeze"]


class Frozen(nnx.Variable):
    """A weight that is read but never trained (not an nnx.Param). A run's `param_dtype`
    applies to it as to the trained weights (`follows_param_dtype`), so that a frozen
    reference equals the policy it was copied from, and a frozen base is stored in the
    dtype the user asked for."""

    follows_param_dtype = True


def _convert(module: nnx.Module, source: type, target: type) -> nnx.Module:
    for _, sub in nnx.iter_modules(module):
        for name, value in list(vars(sub).items()):
            if type(value) is source:
                setattr(sub, name, target(value.get_value(), **value.get_metadata()))
    return module


def freeze(module: nnx.Module) -> nnx.Module:
    """Turn every nnx.Param of `module` into a Frozen variable, in place; returns `module`."""
    return _convert(module, nnx.Param, Frozen)


def unfreeze(module: nnx.Module) -> nnx.Module:
    """Turn every Frozen variable of `module` back into an nnx.Param, in place."""
    return _convert(module, Frozen, nnx.Param)
