"""Accelerator specs for the roofline: the vendors' published figures.

Bandwidths are bytes per second one device can send in one direction. `node` is how many
devices share the fast links (an NVLink island, a TPU slice); a collective whose groups
cross nodes runs at the slower `inter_node` rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from jaxtrain.errors import ArgumentError

TB, GB = 1e12, 1e9


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_flops: float  # dense (no structured sparsity)
    f32_flops: float  # what a float32 matmul runs at by default (TF32 on NVIDIA GPUs)
    hbm_bytes: float
    hbm_bandwidth: float
    intra_node: float
    inter_node: float
    node: int
    source: str
    # Dense FP8 (e4m3) matmuls; None where the chip has no FP8 rate of its own (A100, these
    # TPUs): float8 operands then run no faster than bf16 ones.
    fp8_flops: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


ACCELERATORS = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 989 TFLOPS and TF32 494.5 TFLOPS
    # dense (the sheet's 1,979 / 989 are with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink
    # 900 GB/s (both directions together); DGX H100: one 400 Gb/s ConnectX-7 port per GPU.
    "h100": Accelerator(
        "NVIDIA H100 SXM 80GB",
        989e12,
        494.5e12,
        80 * GB,
        3.35 * TB,
        450 * GB,
        50 * GB,
        8,
        "NVIDIA H100 datasheet; DGX H100 (8 GPUs, 400 Gb/s InfiniBand per GPU)",
        1979e12,  # FP8 3,958 TFLOPS with sparsity
    ),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100's compute, 141 GB HBM3e at
    # 4.8 TB/s, NVLink 900 GB/s; HGX H200 nodes: 400 Gb/s per GPU.
    "h200": Accelerator(
        "NVIDIA H200 SXM 141GB",
        989e12,
        494.5e12,
        141 * GB,
        4.8 * TB,
        450 * GB,
        50 * GB,
        8,
        "NVIDIA H200 datasheet; HGX H200 (8 GPUs, 400 Gb/s InfiniBand per GPU)",
        1979e12,
    ),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): BF16 312 TFLOPS, TF32 156 TFLOPS
    # dense, 2,039 GB/s, NVLink 600 GB/s; DGX A100: one 200 Gb/s HDR port per GPU.
    "a100": Accelerator(
        "NVIDIA A100 SXM 80GB",
        312e12,
        156e12,
        80 * GB,
        2.039 * TB,
        300 * GB,
        25 * GB,
        8,
        "NVIDIA A100 datasheet; DGX A100 (8 GPUs, 200 Gb/s InfiniBand per GPU)",
    ),
    # NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS and TF32 120 TFLOPS with sparsity
    # (121 / 60 dense), 24 GB GDDR6 at 300 GB/s, PCIe Gen4 x16 (64 GB/s) and no NVLink: the
    # one-24-GB-card QLoRA target.
    "l4": Accelerator(
        "NVIDIA L4 24GB",
        121e12,
        60e12,
        24 * GB,
        0.3 * TB,
        32 * GB,
        12.5 * GB,
        8,
        "NVIDIA L4 datasheet (PCIe; a server of 8, 100 Gb/s Ethernet between servers)",
        242.5e12,  # FP8 485 TFLOPS with sparsity
    ),
    # Google Cloud TPU v5e documentation: 197 TFLOPS bf16, 16 GB HBM2 at 819 GB/s, ICI
    # 1,600 Gbps per chip, 256 chips per pod. Data-center network between pods: not in the
    # spec sheet; 6.25 GB/s per chip (a 200 Gbps NIC per 4-chip host) is this table's guess.
    "v5e": Accelerator(
        "Google TPU v5e",
        197e12,
        197e12,
        16 * GB,
        819 * GB,
        200 * GB,
        6.25 * GB,
        256,
        "Google Cloud TPU v5e documentation (inter-pod bandwidth assumed)",
    ),
    # Google Cloud TPU v5p documentation: 459 TFLOPS bf16, 95 GB HBM2e at 2,765 GB/s, ICI
    # 4,800 Gbps per chip, up to 8,960 chips per pod.
    "v5p": Accelerator(
        "Google TPU v5p",
        459e12,
        459e12,
        95 * GB,
        2.765 * TB,
        600 * GB,
        6.25 * GB,
        8960,
        "Google Cloud TPU v5p documentation (inter-pod bandwidth assumed)",
    ),
    # Google Cloud TPU v6e (Trillium) documentation: 918 TFLOPs bf16, 32 GB HBM at 1,638
    # GB/s, ICI 800 GB/s per chip in both directions, 8 chips per host, 256 per pod. Between
    # pods: as v5e, this table's guess.
    "v6e": Accelerator(
        "Google TPU v6e",
        918e12,
        918e12,
        32 * GB,
        1.638 * TB,
        400 * GB,
        6.25 * GB,
        256,
        "Google Cloud TPU v6e documentation (inter-pod bandwidth assumed)",
    ),
}


def accelerator_key(name: str) -> str:
    """The table's key for a spelling such as "H100", "nvidia-h100", "tpu-v5e"."""
    key = name.lower().replace("-", "").replace("nvidia", "").replace("tpu", "").strip()
    if key not in ACCELERATORS:
        raise ArgumentError(f"--accelerator {name!r}: choose one of {', '.join(ACCELERATORS)}.")
    return key


def accelerator(name: str) -> Accelerator:
    return ACCELERATORS[accelerator_key(name)]
