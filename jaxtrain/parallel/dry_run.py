"""Dry run: what a run would put on each device, computed from shapes alone.

Prints the mesh, the per-device bytes of parameters, optimizer state, gradients and a rough
activation estimate, and the sharding of every parameter. Nothing is allocated: the state is
`jax.eval_shape`d, so this works for models far larger than the machine running it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxtrain.config.sections import DataSettings
from jaxtrain.parallel.mesh import describe_mesh
from jaxtrain.pytrees import path_str


def _shard_bytes(leaf: Any, sharding: Any) -> int:
    shape = sharding.shard_shape(tuple(leaf.shape))
    return math.prod(shape) * np.dtype(leaf.dtype).itemsize


def tree_bytes_per_device(abstract: Any, shardings: Any) -> int:
    leaves = jax.tree.leaves(abstract)
    return sum(_shard_bytes(x, s) for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def activation_bytes_estimate(
    config: Any,
    mesh_shape: dict[str, int],
    micro_batch: int,
    seq_len: int,
    *,
    dtype_bytes: int,
    remat: str,
) -> int | None:
    """Rough bytes of activations kept for the backward pass on one device (one micro-batch).

    Per layer and token (no remat): 4*d (norm inputs, residuals) + (N + 2K)*H (q, k, v)
    + N*H (attention output) + N*T (attention probabilities) + 4*f (gate, up, act, down
    input), the head/mlp terms divided by tp; "nothing_saveable" keeps only the layer input
    d per layer plus one layer's worth. Logits add 2*V/tp float32 per token.
    """
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
    if config is None or not all(hasattr(config, n) for n in needed):
        return None
    d, f, layers, vocab = (int(getattr(config, n)) for n in needed)
    heads = int(getattr(config, "num_attention_heads", 1))
    kv = int(getattr(config, "num_key_value_heads", heads))
    head_dim = int(getattr(config, "head_dim", d // heads))
    tp, sp = mesh_shape.get("tp", 1), mesh_shape.get("sp", 1)
    tokens = max(micro_batch // (mesh_shape.get("dp", 1) * mesh_shape.get("fsdp", 1)), 1) * max(
        seq_len // sp, 1
    )
    per_layer = (
        4 * d + ((heads + 2 * kv) * head_dim + heads * head_dim + heads * seq_len + 4 * f) / tp
    )
    kept = layers * d + per_layer if remat == "nothing_saveable" else layers * per_layer
    return int(tokens * (kept * dtype_bytes + 2 * vocab / tp * 4))


def memory_estimate(program: Any, data: DataSettings) -> dict[str, int | None]:
    """Bytes per device of a Program's run (`data`: its batch and sequence; the Program's
    model settings: its dtype and remat),
    from shapes alone: parameters, gradients, optimizer state, frozen weights (a reference, a
    teacher, a LoRA base, quantized or not: counted as `jaxtrain plan` counts them),
    activations (a rough estimate, None when the model's config lacks the sizes) and their
    total (None with it), plus the parameters' bytes over all devices."""
    abstract, shardings = program.abstract_state(), program.state_shardings
    param_b = tree_bytes_per_device(abstract.params, shardings.params)
    opt_b = tree_bytes_per_device(abstract.opt_state, shardings.opt_state)
    frozen_b = tree_bytes_per_device(program.rest, program.plan.param_shardings(program.rest))
    model = program.settings
    dtype_bytes = np.dtype(model.dtype or getattr(program.model, "dtype", np.float32)).itemsize
    act_b = activation_bytes_estimate(
        program.parts.config,
        dict(program.mesh.shape),
        data.micro_batch_size,
        data.seq_len,
        dtype_bytes=dtype_bytes,
        remat=model.remat_policy,
    )
    return {
        "parameters": param_b,
        "gradients": param_b,
        "optimizer_state": opt_b,
        "frozen": frozen_b,
        "activations": act_b,
        "total": None if act_b is None else 2 * param_b + opt_b + frozen_b + act_b,
        "all_parameters": sum(
            math.prod(x.shape) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(abstract.params)
        ),
    }


def dry_run_report(program: Any, data: DataSettings) -> str:
    """The text of `Trainer.dry_run()`: a Program's mesh, memory and shardings."""
    plan = program.plan
    abstract = program.abstract_state()
    shardings = program.state_shardings
    memory = memory_estimate(program, data)
    lines = [
        f"jaxtrain dry run: {describe_mesh(plan.mesh)}",
        f"parameters: {program.parts.num_parameters:,} ({human_bytes(memory['all_parameters'])} in "
        "total)",
        f"global batch: {data.global_batch_size} x {data.seq_len} tokens, "
        f"{data.accumulation_steps} micro-batch(es) of {data.micro_batch_size} rows, "
        f"batch sharding {plan.batch.spec(3, micro_axis=True)}",
        "per device:",
        f"  parameters       {human_bytes(memory['parameters']):>12}",
        f"  gradients        {human_bytes(memory['gradients']):>12}",
        f"  optimizer state  {human_bytes(memory['optimizer_state']):>12}",
    ]
    if memory["frozen"]:
        lines.append(
            f"  frozen weights   {human_bytes(memory['frozen']):>12}  (reference, teacher, base)"
        )
    if memory["activations"] is not None:
        lines.append(
            f"  activations      {human_bytes(memory['activations']):>12}  (rough estimate, "
            f"gradient_checkpointing={program.settings.remat_policy})"
        )
        lines.append(f"  total            {human_bytes(memory['total']):>12}")
    lines.append("parameter shardings (path, shape, dtype, logical axes, spec, per-device shard):")
    params_by_path = jax.tree_util.tree_leaves_with_path(
        abstract.params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    rows = []
    for (path, var), sharding in zip(
        params_by_path, jax.tree.leaves(shardings.params), strict=True
    ):
        axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Variable) else None
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        shape = tuple(value.shape)
        rows.append(
            (
                path_str(path),
                str(shape),
                str(np.dtype(value.dtype)),
                str(tuple(axes)) if axes else "-",
                str(tuple(sharding.spec)),
                str(sharding.shard_shape(shape)),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(6)] if rows else []
    for row in rows:
        lines.append(
            "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        )
    return "\n".join(lines)
