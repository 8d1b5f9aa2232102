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

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.errors import ArgumentError
from jaxtrain.models.frozen import Frozen
from jaxtrain.models.layers import Projection, dense_in_ndim
from jaxtrain.pytrees import path_str
from jaxtrain.quantization.formats import QuantizedMatrix, dequantize, quantize

__all__ = ["QuantizedKernel", "dequantize_base", "quantize_base", "quantized_bytes"]

# Output projections of the model to logits stay in float (as QLoRA keeps lm_head).
KEPT_IN_FLOAT = ("lm_head",)


class QuantizedPart(Frozen):
    """Codes and scales of a quantized kernel: kept in their own dtypes whatever the
    run's param_dtype (a bfloat16 scale would move every weight of its block)."""

    follows_param_dtype = False


class QuantizedKernel(nnx.Module):
    """See the module docstring."""

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
        q = quantize(jnp.reshape(kernel, (rows, cols)), kind, block, double=double)
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

    @property
    def dequantized(self) -> jax.Array:
        """The kernel in float (its original dtype), dequantized from codes and scales."""
        scale2 = None if self.scales_scale is None else self.scales_scale[...]
        q = QuantizedMatrix(self.codes[...], self.scales[...], scale2, self.kind, self.block)
        return dequantize(q, jnp.dtype(self.value_dtype)).reshape(self.shape)

    def __getitem__(self, key: Any) -> jax.Array:
        return self.dequantized[key]

    def get_metadata(self) -> dict[str, Any]:
        return {"logical_axes": self.logical_axes}


def quantize_base(model: nnx.Module, kind: str, block: int, *, double: bool = False) -> nnx.Module:
    """Every frozen Projection kernel of `model` (a LoRA base: its adapters stay float and
    trainable) replaced by a QuantizedKernel, in place; the output head stays float. An
    ArgumentError names a kernel whose rows the block does not divide."""
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, Projection) or not isinstance(module.kernel, Frozen):
            continue
        name = path_str(path)
        if name.split("/")[-1] in KEPT_IN_FLOAT:
            continue
        in_ndim = dense_in_ndim(module.equation)
        kernel = module.kernel.get_value()
        rows = math.prod(kernel.shape[: in_ndim or 1])
        if in_ndim is None or (kind == "nf4" and (rows % block or rows % 2)):
            fits = [d for d in range(2, block + 1, 2) if rows % d == 0]
            hint = f"e.g. {fits[-1]}" if fits else "an even one"
            raise ArgumentError(
                f"quantization block {block} does not divide the {rows} input rows of "
                f"{name}/kernel {tuple(kernel.shape)}; set --quantization_block_size to a "
                f"divisor of {rows} ({hint}), or use --quantization int8."
            )
        axes = tuple(module.kernel.get_metadata().get("logical_axes") or ())
        module.kernel = QuantizedKernel(
            kernel, axes, in_ndim, kind=kind, block=rows if kind == "int8" else block,
            double=double,
        )  # fmt: skip
    return model


def dequantize_base(model: nnx.Module) -> nnx.Module:
    """Every QuantizedKernel of `model` back to a float Frozen kernel, in place (a merged
    export writes float weights)."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Projection) and isinstance(module.kernel, QuantizedKernel):
            quantized = module.kernel
            module.kernel = Frozen(quantized.dequantized, logical_axes=quantized.logical_axes)
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
