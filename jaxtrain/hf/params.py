"""Filling a model's parameters from named tensors (safetensors files or a GGUF reader).

Weights go straight from the (memory-mapped) tensors to their devices, one parameter at a
time: with a ``sharding_for`` callback each device receives only its own slice
(``jax.make_array_from_callback``), so no host ever builds a full copy per device. Shared by
load.py (Hugging Face directories) and gguf.py, which both import it and not each other.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.hf.errors import HFError
from jaxtrain.hf.registry import ModelFamily
from jaxtrain.pytrees import path_str

# sharding_for(path, shape, logical_axes) -> the parameter's Sharding, or None for the default
# device. path is "/"-joined, e.g. "model/layers/0/self_attn/qkv_proj/kernel".
ShardingFor = Callable[
    [str, tuple[int, ...], tuple[str | None, ...]], "jax.sharding.Sharding | None"
]


def load_weights(
    family: ModelFamily,
    config: Any,
    tensors: dict[str, Any],
    *,
    source: str | Path,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    sharding_for: ShardingFor | None = None,
    quantization: Any = None,
) -> nnx.Module:
    """``family.model_class(config)`` filled from ``tensors`` (HF name -> an object with
    ``shape(name)``, ``get(name)``, ``release(name)`` and ``path``, e.g. SafetensorsFile;
    a tensor is released once its parameter holds a copy); every tensor is used
    or ignorable, every parameter found with the shape the config implies.

    ``quantization`` (a BaseQuantization, "nf4" or "int8"): the projections' kernels (all but
    the output head's) are quantized as they are read, one at a time, and stored as the
    frozen base of a QLoRA run; the float kernels never exist together."""
    model_dir = source
    model = nnx.eval_shape(
        lambda: family.model_class(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    )
    quantized = {}
    if quantization is not None:
        from jaxtrain.quantization.kernel import BaseQuantization, quantizable_projections

        quantization = BaseQuantization.of(quantization)
        quantized = quantizable_projections(model)
    maps = {m.path: m for m in family.param_maps(config)}
    used: set[str] = set()
    target = np.dtype(jnp.dtype(param_dtype))
    # The abstract model's variables are filled in place, one tensor at a time.
    for path_tuple, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = path_str(path_tuple)
        spec = maps[key]
        arrays = []
        for name, shape in zip(spec.hf_names, spec.hf_shapes):
            if name not in tensors:
                files = sorted({f.path.name for f in tensors.values()})
                raise HFError(
                    f"{model_dir}: tensor {name!r} is missing (looked in {', '.join(files)}); "
                    f"the config describes a model that needs it for {key}. The weights are "
                    "incomplete or belong to another architecture."
                )
            actual = tensors[name].shape(name)
            if actual != shape:
                raise HFError(
                    f"{tensors[name].path}: tensor {name!r} has shape {list(actual)}, but "
                    f"config.json implies {list(shape)}. The weights do not match the config."
                )
            arrays.append(tensors[name].get(name))
            used.add(name)
        host = spec.to_jax(arrays)
        axes = tuple(var.get_metadata().get("logical_axes") or (None,) * host.ndim)
        sharding = sharding_for(key, host.shape, axes) if sharding_for is not None else None
        value = _place(host, target, sharding)
        if key in quantized:
            _store_quantized(quantized[key], value, key, quantization, sharding_for)
        else:
            var.set_value(value)
        del value  # a quantized kernel's float copy goes now, before the next tensor's
        for name in spec.hf_names:
            tensors[name].release(name)
    extra = sorted(n for n in tensors if n not in used and not family.ignorable(n, config))
    if extra:
        raise HFError(
            f"{model_dir}: {len(extra)} tensor(s) that the config.json model has no place for, "
            f"e.g. {extra[:3]} in {tensors[extra[0]].path.name}. Loading would drop them and "
            "give a different network; check that config.json matches the weights."
        )
    return model


def _store_quantized(
    module: Any, kernel: jax.Array, key: str, quantization: Any, sharding_for: ShardingFor | None
) -> None:
    """`module`'s kernel becomes `kernel` quantized, its codes and scales placed by the
    sharding rules (by their logical axes, as the Trainer places them)."""
    from jaxtrain.quantization.kernel import quantized_kernel

    stored = quantized_kernel(module, kernel, key, quantization)
    for part in ("codes", "scales", "scales_scale"):
        var = getattr(stored, part)
        if var is None or sharding_for is None:
            continue
        value = var.get_value()
        axes = tuple(var.get_metadata().get("logical_axes") or (None,) * value.ndim)
        var.set_value(jax.device_put(value, sharding_for(f"{key}/{part}", value.shape, axes)))
    module.kernel = stored


def _place(host: np.ndarray, dtype: np.dtype, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """Host array -> device array of ``dtype``; with a sharding each device gets its slice."""
    # Always a private copy: on CPU, JAX may alias a numpy buffer, and a buffer backed by
    # the file mapping would change (or fault) if the file were overwritten later.
    if sharding is None:
        return jax.device_put(np.array(host, dtype=dtype, copy=True))
    return jax.make_array_from_callback(
        host.shape, sharding, lambda index: np.array(host[index], dtype=dtype, copy=True)
    )
