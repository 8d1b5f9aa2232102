"""Quantized frozen bases (QLoRA): NF4 and int8 blockwise formats (formats.py) and the
kernels of a LoRA base stored quantized (kernel.py)."""

from jaxtrain.quantization.formats import NF4_TABLE, QuantizedMatrix, dequantize, quantize
from jaxtrain.quantization.kernel import (
    BaseQuantization,
    QuantizedKernel,
    dequantize_base,
    quantize_base,
    quantized_bytes,
)

__all__ = [
    "NF4_TABLE",
    "BaseQuantization",
    "QuantizedKernel",
    "QuantizedMatrix",
    "dequantize",
    "dequantize_base",
    "quantize",
    "quantize_base",
    "quantized_bytes",
]
