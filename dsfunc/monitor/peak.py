"""The peak FLOP/s of one device, that MFU (model FLOPs utilisation) divides by.

Dense (no sparsity) peaks from the vendors' datasheets, for the matrix units in 16-bit (bf16/fp16, fp32
accumulation) and for plain fp32, matched as a whole word in the name torch reports (``torch.cuda.get_device_name``,
e.g. ``NVIDIA H100 80GB HBM3``; an A10G is no A10), more specific names first. An fp32 run counts against the TF32 peak (half the 16-bit one; V100 and T4 have none) when
torch lets matmuls use TF32, else against the fp32 one. The CPU, and a GPU not in the table, have no peak here:
the config's ``flops_profiler.peak_tflops`` (or ``Monitor(peak_tflops=...)``) gives one.
"""

from __future__ import annotations

import re

import torch

# name fragment -> (16-bit dense TFLOP/s, fp32 TFLOP/s); the first fragment found in the device name wins
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "GH200": (989.4, 67.0),
    "H200 NVL": (835.5, 60.0),
    "H200": (989.4, 67.0),
    "H100 NVL": (835.5, 60.0),
    "H100 PCIe": (756.5, 51.2),
    "H100": (989.4, 67.0),  # SXM
    "H800": (989.4, 67.0),
    "H20": (148.0, 44.0),
    "B200": (2250.0, 75.0),
    "A100": (312.0, 19.5),
    "A800": (312.0, 19.5),
    "A10": (125.0, 31.2),
    "L40S": (362.1, 91.6),
    "L40": (181.0, 90.5),
    "L4": (121.0, 30.3),
    "V100": (125.0, 15.7),  # fp16 only: no bf16 matrix units
    "T4": (65.0, 8.1),  # fp16 only
    "MI300X": (1307.4, 163.4),
    "MI250X": (191.5, 23.9),  # per GCD (torch sees each of its two dies as a device)
}
_NO_TF32 = ("V100", "T4")


def device_name(device: torch.device) -> str:
    """``NVIDIA H100 80GB HBM3``-style name of a CUDA device, ``cpu`` otherwise."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The table's dense peak TFLOP/s of ``device`` computing in ``dtype``; None when unknown (the CPU)."""
    return peak_of(device_name(device), dtype) if device.type == "cuda" else None


def peak_of(name: str, dtype: torch.dtype) -> float | None:
    """The table's dense peak TFLOP/s of the GPU called ``name`` computing in ``dtype``; None when unknown."""
    for fragment, (half, single) in PEAK_TFLOPS.items():
        if re.search(rf"\b{fragment}\b", name):
            if dtype != torch.float32:
                return half
            tf32 = torch.get_float32_matmul_precision() != "highest" and fragment not in _NO_TF32
            return half / 2 if tf32 else single
    return None
