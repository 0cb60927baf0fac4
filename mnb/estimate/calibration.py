"""Per-device calibration of the step-time model, kept as data with a source on every number.

What :mod:`mnb.estimate.kernels` needs beyond a device's peak: how close a GEMM
of a given shape comes to the peak, how fast core attention runs, how much of
the memory bandwidth the elementwise and norm kernels reach, and how much of
the link bandwidth a collective reaches.  Each entry is ``(value, source)``;
:func:`mnb.estimate.hardware.register` replaces any of them with a user's own
measurement (``bench/gemm_sweep.py`` measures the GEMM curve and bandwidths on
a GPU, ``%mnb plan --calibrate`` on a live pool).

GEMM curve: fraction of the device's dense peak against the GEMM's *effective
size* ``d = 3 / (1/m + 1/n + 1/k)`` (the harmonic mean of its dimensions: a
square GEMM's side; small when any dimension is small, which is what starves a
GEMM of data reuse), interpolated linearly in log2(d) and held flat outside
the table.

Sources, shortened in the entries below:

- [MMBG] NVIDIA, "Matrix Multiplication Background User's Guide" (A100 fp16
  cuBLAS throughput against GEMM size; large GEMMs reach 80-90 % of peak, sizes
  below ~1k lose half).
- [N21] Narayanan et al. 2021, arXiv 2104.04473: Megatron-LM on DGX A100
  (Selene): 8 NVLink-3 GPUs per node, 8 HDR 200 Gb/s InfiniBand NICs per node.
- [NCCL] nccl-tests all_reduce bus bandwidth published for DGX A100 / DGX H100
  (about 230 GB/s of NVLink-3's 300 GB/s, 360-370 GB/s of NVLink-4's 450 GB/s).
- [B18] this project's BENCHMARKS.md, "One H200, closer to the limit" (issue 18):
  the measured 790 TFLOP/s GEMM peak and ``bench/kernel_profile.py``'s kernel
  time per kind for llama-1b and llama-3b at micro batch 8 (GEMM 1.35 / 3.63 s,
  flash attention 0.21 / 0.41 s, elementwise + norms + mnb's Triton kernels
  0.43 / 0.83 s).
- [SWEEP] ``bench/gemm_sweep.py``'s shapes on one H200 (2026-12-01, torch 2.11 +
  cu130): 120 bf16 GEMMs, squares 256-16384 and Llama-1B/3B/8B/70B's QKV,
  projection, fc1 and fc2 at tp 1-8 with m = 4096 and 16384 tokens, each the
  best of repeats timed with CUDA events; large GEMMs level off at 0.69-0.75 of
  the 989 TFLOP/s datasheet peak (best 744 TFLOP/s on that host; BENCHMARKS.md's
  790 on another); squares below 2048 are launch-latency bound alone and left out.
- [DS] vendor datasheets (HBM bandwidth).
"""

from __future__ import annotations

from typing import Any

Entry = tuple[Any, str]

_MMBG = "NVIDIA Matrix Multiplication Background User's Guide (A100 cuBLAS fp16 GEMM throughput vs size)"
_B18 = "BENCHMARKS.md issue 18: bench/kernel_profile.py on one H200 (llama-1b/-3b, mbs 8)"
_NCCL_A100 = "nccl-tests all_reduce bus bandwidth on DGX A100 (~230 of 300 GB/s NVLink-3)"
_NCCL_H100 = "nccl-tests all_reduce bus bandwidth on DGX H100/H200 (~360 of 450 GB/s NVLink-4)"
_IB = "nccl-tests inter-node all_reduce bus bandwidth, one 200/400 Gb/s NIC per GPU (~90 %)"

_H200_CURVE = (
    (660, 0.30), (977, 0.43), (1507, 0.55), (2048, 0.63), (2879, 0.685), (4030, 0.70), (5898, 0.70),
    (8001, 0.695), (11864, 0.693), (15672, 0.698),
)

CALIBRATION: dict[str, dict[str, Entry]] = {
    "a100": {
        "gemm_curve": (
            ((256, 0.30), (512, 0.50), (1024, 0.66), (2048, 0.75), (4096, 0.80), (8192, 0.83), (16384, 0.85)),
            _MMBG,
        ),
        "attention_fraction": (
            {"flash": 0.45, "unfused": 0.55},
            "flash: FlashAttention-2 on A100 (Dao 2023, ~50 % of peak fwd+bwd); unfused: Megatron's "
            "batched QK^T and (QK^T)V GEMMs at head dim 64-160 [MMBG]",
        ),
        "hbm_bytes_per_s": (2.039e12, "NVIDIA A100 80GB SXM datasheet"),
        "memory_efficiency": (0.70, "fused elementwise/norm kernels (Megatron's apex kernels) on A100, ~70 % of HBM"),
        "intra_efficiency": (0.77, _NCCL_A100),
        "inter_efficiency": (0.90, _IB),
    },
    "h100": {
        "gemm_curve": (
            _H200_CURVE,
            "the H200's measured curve [SWEEP] (the same SM90 die, 132 SMs and clocks; the H200 has more HBM)",
        ),
        "attention_fraction": ({"flash": 0.30, "unfused": 0.40}, _B18 + ": flash attention, head dim 64-128"),
        "hbm_bytes_per_s": (3.35e12, "NVIDIA H100 SXM datasheet"),
        "memory_efficiency": (0.40, _B18 + ": non-GEMM kernels against the bytes they move"),
        "intra_efficiency": (0.80, _NCCL_H100),
        "inter_efficiency": (0.90, _IB),
    },
    "h200": {
        "gemm_curve": (
            _H200_CURVE,
            "[SWEEP] one H200, 2026-12-01: median of bf16 torch.matmul per half octave of effective size",
        ),
        "attention_fraction": ({"flash": 0.30, "unfused": 0.40}, _B18 + ": cuDNN flash attention, head dim 64-128"),
        "hbm_bytes_per_s": (4.8e12, "NVIDIA H200 SXM datasheet"),
        "memory_efficiency": (0.40, _B18 + ": non-GEMM kernels against the bytes they move"),
        "intra_efficiency": (0.80, _NCCL_H100),
        "inter_efficiency": (0.90, _IB),
    },
    "b200": {
        "gemm_curve": (
            ((256, 0.15), (512, 0.30), (1024, 0.48), (2048, 0.62), (4096, 0.70), (8192, 0.75), (16384, 0.78)),
            "H200's curve [B18] shifted one size up (twice the SMs' throughput); not measured",
        ),
        "attention_fraction": ({"flash": 0.30, "unfused": 0.40}, "assumed as the H200 [B18]; not measured"),
        "hbm_bytes_per_s": (8.0e12, "NVIDIA HGX B200 datasheet"),
        "memory_efficiency": (0.40, "assumed as the H200 [B18]; not measured"),
        "intra_efficiency": (0.80, "assumed as NVLink-4 [NCCL]; not measured"),
        "inter_efficiency": (0.90, _IB),
    },
    "cpu": {
        "gemm_curve": (((1, 1.0),), "the CPU peak is itself a measured GEMM rate (mnb.megatron.peak)"),
        "attention_fraction": ({"flash": 0.5, "unfused": 0.5}, "nominal: attention as half-rate GEMMs"),
        "hbm_bytes_per_s": (20e9, "nominal host memory bandwidth per rank"),
        "memory_efficiency": (0.5, "nominal"),
        "intra_efficiency": (0.5, "nominal gloo over loopback"),
        "inter_efficiency": (0.5, "nominal"),
    },
}
"""Per table key of :data:`mnb.estimate.hardware.DEVICES`: name -> (value, source)."""
