"""A Projection's frozen kernel stored quantized, and the pass that quantizes a model's base.

`QuantizedKernel` takes the place of a Projection's `kernel` variable: `kernel[...]` gives the
kernel back in float, so every reader of a kernel (the projection's matmul, the fused q/k/v
slicing, LoRA's merge) runs unchanged; inside the compiled step the dequantization is part of
the program, one layer's kernel at a time, and only the codes and scales are state. The kernel
is viewed as a [rows, cols] matrix (rows: its input dims, cols: its output dims) and quantized
along its rows (formats.py). The codes and scales keep the kernel's logical axis names where a
single dim stands for them (the input dim of a one-input projection, a single output dim), so
the sharding rules place them (fsdp splits the rows); a merged group of dims is replicated.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import ArgumentError
from jaxtrain.models.frozen import Frozen
from jaxtrain.models.layers import Projection, dense_in_ndim
from jaxtrain.pytrees import path_str
from jaxtrain.quantization.formats import KINDS, QuantizedMatrix, dequantize, quantize

__all__ = [
    "BaseQuantization",
    "QuantizedKernel",
    "dequantize_base",
    "is_quantized",
    "quantize_base",
    "quantized_bytes",
]

# Output projections of the model to logits stay in float (as QLoRA keeps lm_head).
KEPT_IN_FLOAT = ("lm_head",)


# Jitted so that NF4's nearest-level search is fused: run eagerly, it materialises 16 float32
# distances a weight (3.8 GB for one 4096 x 14336 kernel of an 8B model).
_quantize = jax.jit(quantize, static_argnames=("kind", "block", "double"))


class QuantizedPart(Frozen):
    """Codes and scales of a quantized kernel: kept in their own dtypes whatever the
    run's param_dtype (a bfloat16 scale would move every weight of its block)."""

    follows_param_dtype = False


class QuantizedKernel(nnx.Module):
    """See the module docstring."""

    is_quantized = True  # LoRA adapts a projection whose kernel this is (models/lora.py)

    def __init__(
        self,
        kernel: jax.Array,
        logical_axes: tuple[str | None, ...],
        in_ndim: int,
        *,
        kind: str,
        block: int,
        double: bool = False,
    ):
        shape = tuple(kernel.shape)
        rows, cols = math.prod(shape[:in_ndim]), math.prod(shape[in_ndim:])
        q = _quantize(jnp.reshape(kernel, (rows, cols)), kind=kind, block=block, double=double)
        axes = logical_axes or (None,) * len(shape)
        row_axis = axes[0] if in_ndim == 1 else None
        col_axis = axes[-1] if len(shape) - in_ndim == 1 else None
        self.codes = QuantizedPart(q.codes, logical_axes=(row_axis, col_axis))
        self.scales = QuantizedPart(q.scales, logical_axes=(row_axis, col_axis))
        self.scales_scale = (
            None
            if q.scales_scale is None
            else QuantizedPart(q.scales_scale, logical_axes=(None, col_axis))
        )
        self.shape, self.kind, self.block = shape, kind, block
        self.logical_axes = tuple(axes)
        self.value_dtype = jnp.dtype(kernel.dtype).name
        # What the step dequantizes to (the run's compute dtype, set like every module's
        # `dtype`; None: value_dtype): a bfloat16 run never holds a float32 copy of a kernel.
        self.dtype: Any = None

    @property
    def dequantized(self) -> jax.Array:
        """The kernel in float (its original dtype), dequantized from codes and scales."""
        return self._dequantize(self.value_dtype)

    def __getitem__(self, key: Any) -> jax.Array:
        """The kernel as the step reads it: dequantized to `dtype` (or value_dtype)."""
        return self._dequantize(self.dtype or self.value_dtype)[key]

    def _dequantize(self, dtype: Any) -> jax.Array:
        scale2 = None if self.scales_scale is None else self.scales_scale[...]
        q = QuantizedMatrix(self.codes[...], self.scales[...], scale2, self.kind, self.block)
        return dequantize(q, jnp.dtype(dtype)).reshape(self.shape)

    def get_metadata(self) -> dict[str, Any]:
        return {"logical_axes": self.logical_axes}


@dataclasses.dataclass(frozen=True)
class BaseQuantization:
    """How a frozen base is stored: `kind` nf4 or int8, NF4's `block` rows per scale,
    `double` quantization of the scales (TrainingArguments' quantization fields)."""

    kind: str
    block: int = 64
    double: bool = False

    @classmethod
    def of(cls, value: BaseQuantization | str | None) -> BaseQuantization | None:
        """A BaseQuantization from itself, a kind name ("nf4", "int8") or None."""
        if value is None or isinstance(value, BaseQuantization):
            return value
        if value not in KINDS:
            raise ArgumentError(f"quantization={value!r}: use one of {list(KINDS)} or None.")
        return cls(value)


def quantized_kernel(
    module: Projection, kernel: jax.Array, name: str, quantization: BaseQuantization
) -> QuantizedKernel:
    """`kernel` (float, the value of `module`'s kernel at `name`) as a QuantizedKernel with
    the kernel's logical axes; an ArgumentError names a kernel whose rows the block does not
    divide."""
    in_ndim = dense_in_ndim(module.equation)
    axes = tuple(module.kernel.get_metadata().get("logical_axes") or ())
    return _quantized(kernel, axes, in_ndim, name, quantization)


def _quantized(
    kernel: jax.Array,
    axes: tuple[str | None, ...],
    in_ndim: int | None,
    name: str,
    quantization: BaseQuantization,
) -> QuantizedKernel:
    rows = math.prod(kernel.shape[: in_ndim or 1])
    kind, block = quantization.kind, quantization.block
    if in_ndim is None or (kind == "nf4" and (rows % block or rows % 2)):
        fits = [d for d in range(2, block + 1, 2) if rows % d == 0]
        hint = f"e.g. {fits[-1]}" if fits else "an even one"
        raise ArgumentError(
            f"quantization block {block} does not divide the {rows} input rows of "
            f"{name} {tuple(kernel.shape)}; set --quantization_block_size to a "
            f"divisor of {rows} ({hint}), or use --quantization int8."
        )
    return QuantizedKernel(
        kernel, axes, in_ndim, kind=kind, block=rows if kind == "int8" else block,
        double=quantization.double,
    )  # fmt: skip


def expert_kernels(model: nnx.Module) -> dict[str, tuple[nnx.Module, str]]:
    """path -> (module, attribute) of every stacked expert kernel: the `expert_kernels` of a
    mixture-of-experts block ([experts, inputs, ...outputs], most of a MoE model's weights)."""
    return {
        f"{path_str(path)}/{attr}": (module, attr)
        for path, module in nnx.iter_modules(model)
        for attr in getattr(module, "expert_kernels", ())
    }


def quantizable_projections(model: nnx.Module) -> dict[str, Projection]:
    """kernel path -> Projection of every kernel a quantized base stores quantized: each
    Projection's but the output head's and those of modules a LoRA run keeps trainable
    (`lora_keep`: a reward model's score head, a classifier)."""
    kept: set[int] = set()
    for _, module in nnx.iter_modules(model):
        for attr in getattr(module, "lora_keep", ()):
            value = getattr(module, attr, None)
            if isinstance(value, nnx.Module):
                kept.update(id(m) for _, m in nnx.iter_modules(value))
    return {
        f"{path_str(path)}/kernel": module
        for path, module in nnx.iter_modules(model)
        if isinstance(module, Projection)
        and path
        and id(module) not in kept
        and path_str(path).split("/")[-1] not in KEPT_IN_FLOAT
    }


def quantize_base(model: nnx.Module, kind: str, block: int, *, double: bool = False) -> nnx.Module:
    """Every frozen Projection kernel of `model` (a LoRA base: its adapters stay float and
    trainable) and every frozen stacked expert kernel replaced by a QuantizedKernel, in place;
    the output head stays float. An ArgumentError names a kernel whose rows the block does
    not divide. An expert kernel is quantized along its experts' input rows (experts x
    inputs rows), its codes and scales replicated (not split over ep)."""
    quantization = BaseQuantization(kind, block, double)
    for name, module in quantizable_projections(model).items():
        if isinstance(module.kernel, Frozen):  # a quantized kernel is not Frozen: done
            module.kernel = quantized_kernel(module, module.kernel.get_value(), name, quantization)
    for name, (module, attr) in expert_kernels(model).items():
        kernel = getattr(module, attr)
        if isinstance(kernel, Frozen):
            axes = tuple(kernel.get_metadata().get("logical_axes") or ())
            quantized = _quantized(kernel.get_value(), axes, 2, name, quantization)
            setattr(module, attr, quantized)
    return model


def is_quantized(model: nnx.Module) -> bool:
    """Whether any kernel of `model` is stored quantized."""
    return any(isinstance(m, QuantizedKernel) for _, m in nnx.iter_modules(model))


def dequantize_base(model: nnx.Module) -> nnx.Module:
    """Every QuantizedKernel of `model` back to a float Frozen kernel, in place (a merged
    export writes float weights)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Projection) and isinstance(module.kernel, QuantizedKernel):
            quantized = module.kernel
            module.kernel = Frozen(quantized.dequantized, logical_axes=quantized.logical_axes)
    for module, attr in expert_kernels(model).values():
        quantized = getattr(module, attr)
        if isinstance(quantized, QuantizedKernel):
            setattr(
                module, attr, Frozen(quantized.dequantized, logical_axes=quantized.logical_axes)
            )
    return model


def quantized_bytes(model: nnx.Module) -> tuple[int, int]:
    """(bytes of the quantized kernels' codes and scales, bytes they stand for in bf16)."""
    stored, bf16 = 0, 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, QuantizedKernel):
            parts = [module.codes, module.scales, module.scales_scale]
            stored += sum(
                math.prod(p.get_value().shape) * jnp.dtype(p.get_value().dtype).itemsize
                for p in parts
                if p is not None
            )  # shapes suffice: an abstract model (a ModelFactory's) counts too
            bf16 += 2 * math.prod(module.shape)
    return stored, bf16
