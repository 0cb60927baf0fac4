"""Per-step memory readings for run records.

GPU ranks read PyTorch's caching allocator (``torch.cuda.memory_allocated``,
``max_memory_allocated``, ``memory_reserved``; the peak is reset at the start
of each step).  CPU ranks have no allocator statistics: they report the
process's resident set size (psutil RSS), with the peak taken as the largest
RSS sampled during the step (sampled whenever a schedule timer stops), so the
numbers include the Python interpreter, Megatron and the dataset.  Readings
carry ``source`` ("cuda" or "rss") so plots can label them.
"""

from __future__ import annotations

import torch


class MemoryMeter:
    """Memory of this rank, step by step."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.source = "cuda" if self.device.type == "cuda" else "rss"
        self._process = None
        if self.source == "rss":
            import psutil

            self._process = psutil.Process()
        self._step_peak = 0
        self.peak_allocated_bytes = 0
        self.peak_reserved_bytes = 0

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def begin_step(self) -> None:
        if self.source == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._step_peak = self._rss()

    def sample(self) -> None:
        """Note the current RSS (CPU); a no-op on GPU, where the allocator tracks peaks."""
        if self.source == "rss":
            self._step_peak = max(self._step_peak, self._rss())

    def end_step(self) -> dict[str, int]:
        """{"mem_allocated_bytes", "mem_peak_bytes", "mem_reserved_bytes"} for the step just run."""
        if self.source == "cuda":
            reading = {
                "mem_allocated_bytes": int(torch.cuda.memory_allocated(self.device)),
                "mem_peak_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                "mem_reserved_bytes": int(torch.cuda.memory_reserved(self.device)),
            }
            reserved_peak = int(torch.cuda.max_memory_reserved(self.device))
        else:
            rss = self._rss()
            self._step_peak = max(self._step_peak, rss)
            reading = {
                "mem_allocated_bytes": rss,
                "mem_peak_bytes": self._step_peak,
                "mem_reserved_bytes": rss,
            }
            reserved_peak = self._step_peak
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, reading["mem_peak_bytes"])
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, reserved_peak)
        return reading

    def capacity_bytes(self) -> int | None:
        """Total memory of the GPU; None on CPU."""
        if self.source == "cuda":
            return int(torch.cuda.get_device_properties(self.device).total_memory)
        return None

    def now(self) -> dict[str, int | None]:
        """Current allocated / peak / reserved bytes, for error messages."""
        if self.source == "cuda":
            return {
                "allocated": int(torch.cuda.memory_allocated(self.device)),
                "peak": int(torch.cuda.max_memory_allocated(self.device)),
                "reserved": int(torch.cuda.memory_reserved(self.device)),
                "capacity": self.capacity_bytes(),
            }
        rss = self._rss()
        return {"allocated": rss, "peak": max(rss, self._step_peak), "reserved": rss, "capacity": None}

    def summary(self) -> dict[str, int | None]:
        return {
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "capacity_bytes": self.capacity_bytes(),
        }
