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

Beyond the datasheet, each device carries the step-time model's calibration
(GEMM efficiency curve, attention efficiency, HBM bandwidth and the share of it
elementwise kernels reach, collective efficiency), from
:mod:`mnb.estimate.calibration`, with the source of every number
(``device.source_of("gemm_curve")``).  :func:`register` adds a device or
replaces numbers with your own measurement::

    >>> from mnb.estimate import hardware
    >>> d = hardware.register("my-h200", base="h200", memory_efficiency=0.5, source="my profile")
    >>> d.memory_efficiency, d.source_of("memory_efficiency"), d.bf16_flops
    (0.5, 'my profile', 989000000000000.0)
    >>> _ = hardware.DEVICES.pop("my-h200")
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from mnb.units import GIB

from .calibration import CALIBRATION


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
    """Where the datasheet numbers come from."""
    hbm_bytes_per_s: float = 2e12
    """Device memory bandwidth (datasheet)."""
    gemm_curve: tuple[tuple[float, float], ...] = ((1, 0.5),)
    """(effective size d = 3/(1/m+1/n+1/k), fraction of peak) points, d ascending."""
    flash_attention_fraction: float = 0.3
    """Core attention (flash/SDPA kernels, masked half skipped) against the peak."""
    unfused_attention_fraction: float = 0.4
    """Core attention as batched GEMMs over the full s x s scores, against the peak."""
    memory_efficiency: float = 0.5
    """Share of ``hbm_bytes_per_s`` that elementwise and norm kernels reach."""
    intra_efficiency: float = 0.8
    """Share of ``intra_node_bytes_per_s`` a large NCCL collective reaches (bus bandwidth)."""
    inter_efficiency: float = 0.9
    """Share of ``inter_node_bytes_per_s`` a large collective across nodes reaches."""
    sources: tuple[tuple[str, str], ...] = ()
    """(field, source) for every calibration number; see :meth:`source_of`."""
    nominal: bool = False
    """Its peak and efficiencies are placeholders, not a model of any machine (the table's CPU): the plan
    predicts no step time or MFU on it (``%mnb plan --calibrate`` measures one)."""
    host_memory: bool = False
    """Its ranks allocate from this machine's RAM (CPU ranks): :func:`rank_capacity_bytes` shares it out."""

    def source_of(self, name: str) -> str:
        """Where the number in field ``name`` comes from."""
        for key, text in self.sources:
            if key == name:
                return text
        if name in {f.name for f in fields(self)}:
            return self.source
        raise ValueError(f"Device has no field {name!r}")


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
            label="NVIDIA H200 (measured bf16 and FP8 GEMM peaks)",
            bf16_flops=790e12,
            fp8_flops=1480e12,
            fp32_flops=395e12,
            capacity_bytes=int(139.7 * GIB),
            intra_node_bytes_per_s=_NVLINK4,
            inter_node_bytes_per_s=_IB400,
            source="largest bf16 torch.matmul throughput measured on this project's H200 (~790 TFLOP/s); FP8: "
                   "torch._scaled_mm, E4M3 tensorwise, 8192^3, 1480 TFLOP/s (2026-12-03, bench/gpu_fp8.py)",
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
            nominal=True,
            host_memory=True,
        ),
    )
}

_CALIBRATED_FIELDS = ("hbm_bytes_per_s", "gemm_curve", "memory_efficiency", "intra_efficiency", "inter_efficiency")


def _calibrated(dev: Device, key: str) -> Device:
    table = CALIBRATION[key]
    values: dict[str, Any] = {name: table[name][0] for name in _CALIBRATED_FIELDS}
    sources = [(name, table[name][1]) for name in _CALIBRATED_FIELDS]
    attention, attention_source = table["attention_fraction"]
    values.update(flash_attention_fraction=attention["flash"], unfused_attention_fraction=attention["unfused"])
    sources += [("flash_attention_fraction", attention_source), ("unfused_attention_fraction", attention_source)]
    if dev.name != key:  # a device measured against another peak: the same kernels, other fractions
        scale = DEVICES[key].bf16_flops / dev.bf16_flops
        values["gemm_curve"] = tuple((d, min(1.0, f * scale)) for d, f in values["gemm_curve"])
        values["flash_attention_fraction"] *= scale
        values["unfused_attention_fraction"] *= scale
    return replace(dev, **values, sources=tuple(sources))


for _name, _dev in list(DEVICES.items()):
    _key = "h200" if _name == "h200-measured" else _name
    DEVICES[_name] = _calibrated(_dev, _key)


def register(name: str, *, source: str, base: str | None = None, label: str | None = None,
             **numbers: Any) -> Device:
    """Add a device or replace numbers of one, each with ``source`` (required); returns it.

    ``base`` (a table key) supplies the numbers not given, else the device ``name``
    itself if it exists; a new device without a base must give every datasheet field.
    ``numbers`` are :class:`Device` fields (``bf16_flops``, ``gemm_curve``,
    ``memory_efficiency``, ``intra_node_bytes_per_s``, ...)::

        hardware.register("h200", gemm_curve=((1024, 0.55), (8192, 0.78)), source="bench/gemm_sweep.py, 2026-12-02")
    """
    if not isinstance(source, str) or not source.strip():
        raise ValueError("register needs source='where the numbers come from'")
    known = {f.name for f in fields(Device)} - {"name", "sources", "source", "label"}
    unknown = sorted(set(numbers) - known)
    if unknown:
        raise ValueError(f"unknown Device field(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    if "gemm_curve" in numbers:
        numbers["gemm_curve"] = _check_curve(numbers["gemm_curve"])
    for key in ("memory_efficiency", "intra_efficiency", "inter_efficiency",
                "flash_attention_fraction", "unfused_attention_fraction"):
        if key in numbers and not 0 < numbers[key] <= 1:
            raise ValueError(f"{key} must be in (0, 1], got {numbers[key]!r}")
    key = name.strip().lower()
    start = base if base is not None else (key if key in DEVICES else None)
    if start is None:
        missing = [f.name for f in fields(Device) if f.name in _DATASHEET and f.name not in numbers]
        if missing:
            raise ValueError(f"a new device {name!r} needs base='h200' (or another table key) or {', '.join(missing)}")
        dev = Device(name=key, label=label or name, source=source, **numbers)
        dev = replace(dev, sources=tuple((k, source) for k in numbers))
    else:
        parent = device(start)
        sources = dict(parent.sources)
        sources.update({k: source for k in numbers})
        dev = replace(parent, name=key, label=label or (parent.label if key == parent.name else name),
                      sources=tuple(sources.items()), **numbers)
    DEVICES[key] = dev
    return dev


_DATASHEET = ("bf16_flops", "fp8_flops", "fp32_flops", "capacity_bytes", "intra_node_bytes_per_s",
              "inter_node_bytes_per_s")


def _check_curve(curve: Any) -> tuple[tuple[float, float], ...]:
    try:
        points = tuple(sorted((float(d), float(f)) for d, f in curve))
    except (TypeError, ValueError):
        raise ValueError(f"gemm_curve must be (effective size, fraction of peak) pairs, got {curve!r}") from None
    if not points or any(d <= 0 or not 0 < f <= 1 for d, f in points):
        raise ValueError(f"gemm_curve needs sizes > 0 and fractions in (0, 1], got {curve!r}")
    return points


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


def host_memory_bytes() -> int:
    """This machine's RAM (Linux: mnb's ranks run there)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def rank_capacity_bytes(dev: Device, ranks_on_host: int) -> int | None:
    """Memory one rank may use: the device's own, or for CPU ranks this machine's RAM shared by the ranks
    on it (every CPU rank of a node allocates from the one host memory).  None where unknown."""
    if dev.capacity_bytes is not None:
        return dev.capacity_bytes
    if dev.host_memory:
        return host_memory_bytes() // max(1, ranks_on_host)
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
