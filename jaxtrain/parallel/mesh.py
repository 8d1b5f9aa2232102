"""The device mesh: five named axes (dp, fsdp, ep, tp, sp) built from `sharding_axis_dims`.

- dp: data parallel (parameters replicated, batch split),
- fsdp: fully sharded data parallel (batch split and parameters sharded),
- ep: expert parallel, tp: tensor parallel (heads / mlp), sp: sequence parallel.

Devices are ordered by (process, id) before the reshape, so the innermost axes (sp, tp, ep)
stay inside one host and each host owns a contiguous block of the batch axes. That is what
lets every host feed only its own rows (see `batch.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxtrain.config.tables import MESH_AXES, parse_axis_dims
from jaxtrain.errors import MeshError

BATCH_AXES = ("dp", "fsdp")
SEQUENCE_AXIS = "sp"


def resolve_axis_dims(dims: object, device_count: int) -> tuple[int, ...]:
    """Replace the -1 entry with the remaining devices and check the product fits."""
    dims = parse_axis_dims(dims)
    named = dict(zip(MESH_AXES, dims, strict=True))
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        if device_count % known:
            raise MeshError(
                f"sharding_axis_dims={dims}: the fixed axes use {known} devices, which does not "
                f"divide the {device_count} devices available, so -1 has no integer size. "
                f"Choose sizes whose product divides {device_count}."
            )
        dims = tuple(device_count // known if d == -1 else d for d in dims)
    elif math.prod(dims) != device_count:
        raise MeshError(
            f"sharding_axis_dims={dims} ({named}) multiplies to {math.prod(dims)} devices, but "
            f"{device_count} are available. Make the product {device_count}, or put -1 on one "
            "axis to give it the remaining devices."
        )
    return dims


def build_mesh(
    axis_dims: object = (1, -1, 1, 1, 1), devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A Mesh over `devices` (default: all) with axes MESH_AXES (Auto axis types, GSPMD)."""
    devices = list(jax.devices() if devices is None else devices)
    dims = resolve_axis_dims(axis_dims, len(devices))
    devices.sort(key=lambda d: (d.process_index, d.id))
    processes = len({d.process_index for d in devices})
    if processes > 1:
        local = len(devices) // processes
        inner = math.prod(dims[2:])  # ep * tp * sp
        if local % inner:
            raise MeshError(
                f"sharding_axis_dims={dims}: ep*tp*sp={inner} must divide the {local} devices "
                "of each host, so that hosts split only the batch axes (dp, fsdp) and each "
                "host can feed whole rows of its own data."
            )
    grid = np.array(devices, dtype=object).reshape(dims)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe_mesh(mesh: Mesh) -> str:
    sizes = ", ".join(f"{name}={size}" for name, size in mesh.shape.items())
    kind = mesh.devices.flat[0].device_kind
    return f"mesh({sizes}) over {mesh.devices.size} x {kind} in {jax.process_count()} process(es)"
