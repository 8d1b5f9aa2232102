"""A roofline estimate of one train step from the compiled program's figures.

Per device:
  compute        the program's matmul FLOPs (loops counted, remat's recompute included) at
                 the accelerator's peak for the run's compute dtype; at least the model's
                 FLOPs, since a kernel the compiler calls out to (cuDNN's fused attention on
                 XLA:GPU) counts none. With fp8_matmuls, the projections' share of the model's
                 FLOPs (`fp8_model_flops`) runs at the accelerator's FP8 rate, where it has one
  memory         XLA's bytes accessed at HBM bandwidth
  communication  each collective's per-device link bytes (ring algorithms: (n-1)/n of the
                 tensor, twice for an all-reduce) at the intra-node rate, or the inter-node
                 rate when its groups span nodes
The step takes at least max(compute, memory, communication) (everything overlapped) and at
most max(compute, memory) + communication (nothing overlapped); the plan ranks by the latter
and gives MFU for both. MFU counts model FLOPs (causal attention, no recompute), as the
Trainer logs it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxtrain.planning.accelerators import Accelerator


def node_of_partition(devices: int, per_node: int) -> list[int]:
    """The node of each partition id: the mesh lays devices out in id order, node-major."""
    return [int(i) // max(per_node, 1) for i in range(devices)]


def communication_seconds(
    ops: list[dict[str, Any]], node_of: list[int], accel: Accelerator
) -> dict[str, float]:
    intra = inter = 0.0
    for op in ops:
        spans = any(len({node_of[p] for p in group}) > 1 for group in op["groups"] if group)
        if spans:
            inter += op["link_bytes"] / accel.inter_node
        else:
            intra += op["link_bytes"] / accel.intra_node
    return {"intra_node": intra, "inter_node": inter}


def estimate(
    figures: dict[str, Any],
    accel: Accelerator,
    *,
    devices: int,
    per_node: int,
    dtype: Any,
) -> dict[str, Any]:
    low_precision = dtype is not None and np.dtype(dtype).itemsize <= 2
    peak = accel.bf16_flops if low_precision else accel.f32_flops
    model_flops_per_device = figures["model_flops"] / devices
    fp8 = figures.get("fp8_model_flops", 0.0) / devices
    fp8_peak = accel.fp8_flops or peak
    compute = (max(figures["matmul_flops"], model_flops_per_device) - fp8) / peak + fp8 / fp8_peak
    memory = figures["bytes_accessed"] / accel.hbm_bandwidth
    links = communication_seconds(
        figures["collective_ops"], node_of_partition(devices, per_node), accel
    )
    communication = links["intra_node"] + links["inter_node"]
    overlapped = max(compute, memory, communication)
    serial = max(compute, memory) + communication
    peak_bytes = figures["peak_bytes"]
    return {
        "peak_flops_per_device": peak,
        "compute_s": compute,
        "memory_s": memory,
        "communication_s": links,
        "step_time_s": {"overlapped": overlapped, "serial": serial},
        "mfu": {
            "overlapped": model_flops_per_device / (overlapped * peak) if overlapped else None,
            "serial": model_flops_per_device / (serial * peak) if serial else None,
        },
        "bound": max(
            ("compute", compute),
            ("memory", memory),
            ("communication", communication),
            key=lambda kv: kv[1],
        )[0],
        "hbm_bytes": accel.hbm_bytes,
        "fits": peak_bytes <= accel.hbm_bytes,
        "headroom_bytes": accel.hbm_bytes - peak_bytes,
        # By the shape estimate (program.shape_estimate): where XLA:CPU's schedule and an
        # accelerator's disagree, the truth lies between the two.
        "fits_by_shapes": figures["shape_estimate_bytes"] <= accel.hbm_bytes,
    }
