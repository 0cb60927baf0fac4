"""Hardware table: peak throughput, memory capacity and link bandwidth per device.

Peaks are *dense* (no 2:4 sparsity) tensor-core numbers from the vendors'
datasheets; formulas never hard-code them, they look them up here (or take a
``peak_flops`` argument)::

    >>> from mnb.estimate import hardware
    >>> hardware.peak_flops("h200")          # datasheet dense bf16
    989000000000000.0
    >>> hardware.peak_flops("h200-measured") # bf16 GEMM peak measured on this project's H200
    790000000000000.0

Capacities are roughly what ``torch.cuda.get_device_properties(i).total_memory``
reports (a little below the marketing "80 GB"/"141 GB"), since that is what an
allocation can reach.  Bandwidths are per GPU, one direction, in bytes/s.
"""

from __future__ import annotations

from dataclasses import dataclass

from mnb.units import GIB


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or the CPU) as the estimators see it."""

    name: str
    """Table key, e.g. 'h200'."""
    label: str
    """Human-readable name."""
    bf16_flops: float
    """Dense bf16/fp16 tensor peak, FLOP/s."""
    fp8_flops: float | None
    """Dense fp8 tensor peak, FLOP/s (None: not supported)."""
    fp32_flops: float
    """fp32 peak used for fp32 training (TF32 tensor cores where Megatron enables them)."""
    capacity_bytes: int | None
    """Usable device memory (None for the CPU: host memory varies)."""
    intra_node_bytes_per_s: float
    """Per-GPU one-direction bandwidth inside a node (NVLink)."""
    inter_node_bytes_per_s: float
    """Per-GPU one-direction bandwidth across nodes (one 400 Gb/s NIC per GPU)."""
    source: str
    """Where the numbers come from."""


_NVLINK4 = 450e9  # NVLink 4: 900 GB/s bidirectional per GPU
_NVLINK3 = 300e9  # NVLink 3: 600 GB/s bidirectional per GPU
_NVLINK5 = 900e9  # NVLink 5: 1.8 TB/s bidirectional per GPU
_IB400 = 50e9  # 400 Gb/s NDR per GPU

DEVICES: dict[str, Device] = {
    d.name: d
    for d in (
        Device(
            name="h100",
            label="NVIDIA H100 SXM 80GB",
            bf16_flops=989e12,
            fp8_flops=1979e12,
            fp32_flops=494.7e12,
            capacity_bytes=int(79.2 * GIB),
            intra_node_bytes_per_s=_NVLINK4,
            inter_node_bytes_per_s=_IB400,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM, dense)",
        ),
        Device(
            name="h200",
            label="NVIDIA H200 SXM 141GB",
            bf16_flops=989e12,
            fp8_flops=1979e12,
            fp32_flops=494.7e12,
            capacity_bytes=int(139.7 * GIB),
            intra_node_bytes_per_s=_NVLINK4,
            inter_node_bytes_per_s=_IB400,
            source="NVIDIA H200 Tensor Core GPU datasheet (SXM, dense)",
        ),
        Device(
            name="h200-measured",
            label="NVIDIA H200 (measured bf16 GEMM peak)",
            bf16_flops=790e12,
            fp8_flops=None,
            fp32_flops=395e12,
            capacity_bytes=int(139.7 * GIB),
            intra_node_bytes_per_s=_NVLINK4,
            inter_node_bytes_per_s=_IB400,
            source="largest bf16 torch.matmul throughput measured on this project's H200 (~790 TFLOP/s)",
        ),
        Device(
            name="a100",
            label="NVIDIA A100 SXM 80GB",
            bf16_flops=312e12,
            fp8_flops=None,
            fp32_flops=156e12,
            capacity_bytes=int(79.2 * GIB),
            intra_node_bytes_per_s=_NVLINK3,
            inter_node_bytes_per_s=25e9,
            source="NVIDIA A100 Tensor Core GPU datasheet (SXM, dense)",
        ),
        Device(
            name="b200",
            label="NVIDIA B200 (HGX)",
            bf16_flops=2250e12,
            fp8_flops=4500e12,
            fp32_flops=1125e12,
            capacity_bytes=int(178.4 * GIB),
            intra_node_bytes_per_s=_NVLINK5,
            inter_node_bytes_per_s=_IB400,
            source="NVIDIA HGX B200 datasheet (per GPU, dense)",
        ),
        Device(
            name="cpu",
            label="CPU (nominal)",
            bf16_flops=1e12,
            fp8_flops=None,
            fp32_flops=1e12,
            capacity_bytes=None,
            intra_node_bytes_per_s=5e9,
            inter_node_bytes_per_s=1e9,
            source="nominal 1 TFLOP/s so that CPU runs get an MFU figure; not a measurement",
        ),
    )
}

_ALIASES = {
    "h100-sxm": "h100",
    "h100 sxm": "h100",
    "h200-sxm": "h200",
    "a100-80gb": "a100",
    "a100 80gb": "a100",
}


def device(name: str) -> Device:
    """Look up a table entry by key ('h200'), alias or a CUDA device name."""
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in DEVICES:
        return DEVICES[key]
    guessed = device_from_name(name)
    if guessed is not None:
        return guessed
    raise ValueError(f"unknown device {name!r}; choose from {', '.join(DEVICES)} or pass peak_flops=")


def device_from_name(device_name: str | None) -> Device | None:
    """Map ``torch.cuda.get_device_name()`` text (e.g. 'NVIDIA H200') to a table entry.

    Returns None for names that are not in the table (the caller decides whether
    that means "no MFU" or an error).
    """
    if not device_name:
        return None
    text = device_name.lower()
    if text.startswith("cpu"):
        return DEVICES["cpu"]
    for key in ("b200", "h200", "h100", "a100"):
        if key in text:
            return DEVICES[key]
    return None


def peak_flops(name: str, dtype: str = "bf16") -> float:
    """Dense peak FLOP/s of one device for ``dtype`` in {'bf16', 'fp16', 'fp8', 'fp32'}."""
    dev = device(name)
    if dtype in ("bf16", "fp16"):
        return dev.bf16_flops
    if dtype == "fp8":
        if dev.fp8_flops is None:
            raise ValueError(f"{dev.label} has no fp8 peak in the table; use dtype='bf16'")
        return dev.fp8_flops
    if dtype == "fp32":
        return dev.fp32_flops
    raise ValueError(f"dtype must be one of bf16, fp16, fp8, fp32, got {dtype!r}")


def train_dtype(bf16: bool, fp8: bool = False) -> str:
    """The peak column that matches a TrainConfig's precision flags."""
    if fp8:
        return "fp8"
    return "bf16" if bf16 else "fp32"
