"""The device mesh: five named axes (dp, fsdp, ep, tp, sp) built from `sharding_axis_dims`.

- dp: data parallel (parameters replicated, batch split),
- fsdp: fully sharded data parallel (batch split and parameters sharded),
- ep: expert parallel, tp: tensor parallel (heads / mlp), sp: sequence parallel.

Devices are ordered by (process, id) before the reshape, so the innermost axes (sp, tp, ep)
stay inside one host and each host owns a contiguous block of the batch axes. That is what
lets every host feed only its own rows (see `batch.py`).
"""

from __future__ import annotations

import contextlib
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


# A run restored on other devices (export, sample, eval): every device on fsdp fits any model,
# since fsdp shards only the dimensions it divides and leaves the others whole.
ALL_ON_FSDP = (1, -1, 1, 1, 1)
_MODEL_AXES = slice(2, 5)  # ep, tp, sp: sizes the model's parameters (or rows) must divide


def restore_axis_dims(
    run_dims: object,
    device_count: int,
    *,
    trained_devices: int | None = None,
    rows: int | None = None,
    seq_len: int | None = None,
    processes: int = 1,
) -> tuple[tuple[int, ...], int]:
    """(sharding_axis_dims, how many of the devices) to restore a run trained on `run_dims`
    (over `trained_devices`, when known) onto `device_count` devices; `rows` and `seq_len`: an
    eval batch the mesh must split.

    The run's own mesh when it fits: it builds here with the ep, tp and sp sizes it trained
    with (each divided the model's parameters; a -1 there may resolve to another size), over
    all the devices or (one process) as many as trained it. Else every device on fsdp; else
    (a batch that fsdp does not split) one device, in one process.
    """
    run_dims = parse_axis_dims(run_dims)
    try:
        trained = resolve_axis_dims(run_dims, trained_devices) if trained_devices else None
    except MeshError:
        trained = None  # a count that does not fit its dims: not what trained it

    def fits(dims: tuple[int, ...], count: int, model_axes: tuple[int, ...] | None) -> bool:
        try:
            sizes = resolve_axis_dims(dims, count)
        except MeshError:
            return False
        return (
            model_axes in (None, sizes[_MODEL_AXES])
            and (count // processes) % math.prod(sizes[_MODEL_AXES]) == 0
            and (rows is None or rows % (sizes[0] * sizes[1]) == 0)
            and (seq_len is None or seq_len % sizes[4] == 0)
        )

    model_axes = trained[_MODEL_AXES] if trained else None
    if fits(run_dims, device_count, model_axes):
        return run_dims, device_count
    single = processes == 1
    fewer = trained is not None and trained_devices < device_count
    if single and fewer and fits(run_dims, trained_devices, model_axes):
        return trained, trained_devices  # the run's own mesh, on part of the devices
    on_fsdp = resolve_axis_dims(ALL_ON_FSDP, device_count)
    if not single or fits(on_fsdp, device_count, None):
        return on_fsdp, device_count  # a batch that does not split is then said by its check
    return (1, 1, 1, 1, 1), 1


def describe_restore(
    run_dims: object, trained_devices: int | None, dims: object, count: int, device_count: int
) -> str:
    """The line saying a run is restored onto `dims` over `count` of the `device_count`
    devices here (restore_axis_dims), not the mesh it trained on."""
    run_dims = parse_axis_dims(run_dims)
    if trained_devices is None and -1 not in run_dims:
        trained_devices = math.prod(run_dims)
    trained = f"the mesh sharding_axis_dims={run_dims}"  # a -1, and no record of the devices
    if trained_devices:
        with contextlib.suppress(MeshError):
            sizes = "x".join(map(str, resolve_axis_dims(run_dims, trained_devices)))
            trained = f"a {sizes} mesh of {trained_devices} device{'s' * (trained_devices > 1)}"
    shape = "x".join(map(str, resolve_axis_dims(dims, count)))
    if count == 1:
        target = "1 device"
    elif count < device_count:
        target = f"{count} of the {device_count} devices here, as {shape}"
    else:
        target = f"{count} devices on fsdp ({shape})"
    return f"the run trained on {trained}; restoring onto {target}"
