"""Accelerator specs: the MFU denominator, the power estimate when NVML cannot be read, and the
planner's model of a machine. Dense (no sparsity) per-GPU figures from the vendors' datasheets
(SXM / HGX parts); bandwidths in bytes/s, one direction.
"""

from __future__ import annotations

from dataclasses import dataclass

TB, GB = 1e12, 1e9


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float
    fp8_flops: float  # 0: no float8 matmuls
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_bandwidth: float  # per GPU, one direction, inside the NVLink domain
    network_bandwidth: float  # per GPU, one direction, between NVLink domains
    nvlink_domain: int  # GPUs per NVLink domain (a node, or a rack for GB200 NVL72)
    tdp_watts: float


# Matched by substring of torch.cuda.get_device_name(), first match wins: longer names first.
GPUS = [
    GPU("GB200", 2.5e15, 5.0e15, 186 * GB, 8.0 * TB, 900 * GB, 100 * GB, 72, 1200),
    GPU("B200", 2.25e15, 4.5e15, 180 * GB, 8.0 * TB, 900 * GB, 50 * GB, 8, 1000),
    GPU("H200", 989e12, 1979e12, 141 * GB, 4.8 * TB, 450 * GB, 50 * GB, 8, 700),
    GPU("H100 PCIe", 756e12, 1513e12, 80 * GB, 2.0 * TB, 300 * GB, 50 * GB, 2, 350),
    GPU("H100 96GB", 989e12, 1979e12, 96 * GB, 2.4 * TB, 450 * GB, 50 * GB, 8, 700),  # HBM2e SXM (Meta's Grand Teton)
    GPU("H100", 989e12, 1979e12, 80 * GB, 3.35 * TB, 450 * GB, 50 * GB, 8, 700),
    GPU("H800", 989e12, 1979e12, 80 * GB, 3.35 * TB, 200 * GB, 50 * GB, 8, 700),
    GPU("A100 40GB", 312e12, 0, 40 * GB, 1.555 * TB, 300 * GB, 25 * GB, 8, 400),
    GPU("A100", 312e12, 0, 80 * GB, 2.0 * TB, 300 * GB, 25 * GB, 8, 400),
    GPU("A800", 312e12, 0, 80 * GB, 2.0 * TB, 200 * GB, 25 * GB, 8, 400),
    GPU("L40S", 362e12, 733e12, 48 * GB, 0.864 * TB, 32 * GB, 25 * GB, 1, 350),
    GPU("A10G", 125e12, 0, 24 * GB, 0.6 * TB, 32 * GB, 12.5 * GB, 1, 300),
    GPU("MI325X", 1307e12, 2615e12, 256 * GB, 6.0 * TB, 448 * GB, 50 * GB, 8, 1000),
    GPU("MI300X", 1307e12, 2615e12, 192 * GB, 5.3 * TB, 448 * GB, 50 * GB, 8, 750),
]


def find_gpu(name: str) -> GPU | None:
    """The spec whose name is a substring of `name` (case-insensitive), e.g. 'NVIDIA H200'."""
    for gpu in GPUS:
        if gpu.name.lower() in name.lower():
            return gpu
    return None
