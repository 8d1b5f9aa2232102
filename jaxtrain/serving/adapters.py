"""Several LoRA adapters served on one base model, chosen per request.

`load_adapters(model, {name: directory})` reads PEFT adapter directories (what
`save_peft_adapter`, `jaxtrain export` of a LoRA run and Hugging Face's peft write:
adapter_config.json + adapter_model.safetensors) onto the base model, in place: each adapted
projection's `lora` becomes an `AdapterChoice` holding one jaxtrain LoRA per adapter that
targets it (a fused projection's q/k/v or gate/up parts each their own, as PEFT keeps them).
A row of a batch is computed with one adapter, or none: the engine sets each AdapterChoice's
`rows` [B] (0: the base; i: the i-th adapter) inside its compiled steps (`choose_adapters`),
so one decode step serves requests of different adapters together.

Each adapter computes its low-rank delta on every row, masked to its own rows: a step costs
the base plus, per adapter, 2 r (in + out) multiply-adds a token and projection (four rank-16
adapters on SmolLM2-135M: 0.91x the base's tokens/s on CPU, bench/serve_adapters.py; vLLM's
punica kernels gather each row's adapter instead, which pays with many adapters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.errors import ArgumentError
from jaxtrain.models.layers import Projection
from jaxtrain.models.lora import FUSED_PARTS, LoRA, part_slices

__all__ = ["AdapterChoice", "adapter_count", "choose_adapters", "load_adapters"]

PEFT_PREFIX = "base_model.model."
# adapter_config.json settings whose non-default values these adapters do not compute.
UNSUPPORTED = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {},
               "lora_bias": False, "modules_to_save": []}  # fmt: skip


class AdapterChoice(nnx.Module):
    """One projection's adapters, by adapter index (from 1); row b gets adapter rows[b]."""

    def __init__(self, adapters: dict[int, list[LoRA]]):
        # Index -> the adapter's LoRA modules on this projection (several: fused parts).
        self.adapters = nnx.Dict({str(i): nnx.List(parts) for i, parts in adapters.items()})
        self.rows: jax.Array | None = nnx.data(None)  # [B] int32, set inside a step

    def __call__(self, x: jax.Array) -> jax.Array:
        rows = jnp.zeros(x.shape[0], jnp.int32) if self.rows is None else self.rows
        y = None
        for index, parts in self.adapters.items():
            mine = (rows == int(index)).reshape(-1, *(1,) * (x.ndim - 1))
            masked = jnp.where(mine, x, 0).astype(x.dtype)  # the delta is linear in x
            for lora in parts:
                out = lora(masked)
                y = out if y is None else y + out
        return y


def adapter_count(model: nnx.Module) -> int:
    """How many adapters `load_adapters` put on `model` (0: none)."""
    return max(
        (int(i) for _, m in nnx.iter_modules(model) if isinstance(m, AdapterChoice)
         for i in m.adapters),
        default=0,
    )  # fmt: skip


def choose_adapters(model: nnx.Module, rows: jax.Array | None) -> None:
    """Every row's adapter for the next forward (`rows` [B]: 0 the base, i adapter i; None:
    the base for every row)."""
    for _, m in nnx.iter_modules(model):
        if isinstance(m, AdapterChoice):
            m.rows = rows


def load_adapters(model: nnx.Module, directories: dict[str, str | Path]) -> list[str]:
    """Put the PEFT adapters in `directories` (name -> directory) on `model`, in place; returns
    the names in index order (adapter i is names[i - 1]). ArgumentError names the directory
    and what does not fit: a setting these adapters do not compute, a module the model does
    not have, a tensor of the wrong size."""
    projections = {
        ".".join(str(p) for p in path): m
        for path, m in nnx.iter_modules(model)
        if isinstance(m, Projection) and path
    }
    chosen: dict[str, dict[int, list[LoRA]]] = {}
    for index, directory in enumerate(directories.values(), start=1):
        rank, alpha, tensors = _read_peft(Path(directory))
        for stem, (a, b) in tensors.items():
            where, lora = _adapter_on(projections, stem, rank, alpha, Path(directory))
            lora.a[...] = _shaped(a.T, lora.a[...], stem, directory)
            lora.b[...] = _shaped(b.T, lora.b[...], stem, directory)
            chosen.setdefault(where, {}).setdefault(index, []).append(lora)
    for where, adapters in chosen.items():
        projections[where].lora = AdapterChoice(adapters)
    return list(directories)


def _read_peft(directory: Path) -> tuple[int, float, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """(r, lora_alpha, {module path: (lora_A [r, in], lora_B [out, r])}) of a PEFT directory."""
    from safetensors.numpy import load_file

    config_path, weights = (
        directory / "adapter_config.json",
        directory / "adapter_model.safetensors",
    )
    if not config_path.is_file() or not weights.is_file():
        raise ArgumentError(
            f"{directory}: not a PEFT adapter directory (adapter_config.json and "
            "adapter_model.safetensors); export a LoRA run with jaxtrain export."
        )
    config = json.loads(config_path.read_text())
    for key, default in UNSUPPORTED.items():
        if config.get(key) not in (None, default):
            raise ArgumentError(f"{config_path}: {key}={config[key]!r} is not served yet.")
    if config.get("peft_type", "LORA") != "LORA":
        raise ArgumentError(f"{config_path}: peft_type {config['peft_type']!r} is not LoRA.")
    tensors = load_file(str(weights))
    pairs = {}
    for key, a in tensors.items():
        if key.endswith(".lora_A.weight"):
            stem = key[: -len(".lora_A.weight")].removeprefix(PEFT_PREFIX)
            pairs[stem] = (a.astype(np.float32), tensors[key.replace(".lora_A.", ".lora_B.")])
    if not pairs:
        raise ArgumentError(f"{weights}: no lora_A / lora_B tensors in it.")
    return int(config["r"]), float(config["lora_alpha"]), pairs


def _adapter_on(
    projections: dict[str, Projection], stem: str, rank: int, alpha: float, directory: Path
) -> tuple[str, LoRA]:
    """(the projection's path, a LoRA of this adapter on it) of PEFT module `stem`: the
    projection itself, or its part of a fused one (q_proj of qkv_proj)."""
    parent, _, module = stem.rpartition(".")
    if stem in projections:
        return stem, _lora(projections[stem], rank, alpha)
    for fused, (_, parts) in FUSED_PARTS.items():
        where = f"{parent}.{fused}"
        if module in parts and where in projections:
            part = part_slices(projections[where], fused)[module]
            return where, _lora(projections[where], rank, alpha, part)
    raise ArgumentError(
        f"{directory}: the adapter targets {stem}, which this base model does not have; "
        "serve it on the base model it was trained on."
    )


def _lora(base: Projection, rank: int, alpha: float, part: Any = None) -> LoRA:
    return LoRA(base, rank=rank, alpha=alpha, dropout=0.0, key=jax.random.key(0), part=part)


def _shaped(value: np.ndarray, like: jax.Array, stem: str, directory: Any) -> jax.Array:
    """`value` (a PEFT factor, transposed) in the layout of the LoRA factor `like`."""
    if value.size != like.size:
        raise ArgumentError(
            f"{directory}: {stem} has a factor of {value.size} values where this base model's "
            f"projection takes {like.size} ({like.shape}); serve it on its own base model."
        )
    return jnp.asarray(value.reshape(like.shape), like.dtype)
