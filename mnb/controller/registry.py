"""What the notebook side remembers between cells: the current pool and the last run.

Behind ``mnb.pool()`` and ``mnb.last_run``; plain module state of the notebook kernel
(no process groups, no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mnb.errors import PoolError

if TYPE_CHECKING:
    from mnb.controller.pool import Pool

_CURRENT: list["Pool"] = []
_LAST_RUN: list[Any] = []
_CPU_PEAK: dict[str, float] = {}


def current_pool(required: bool = True) -> "Pool | None":
    if _CURRENT:
        return _CURRENT[-1]
    if required:
        raise PoolError("no pool is running; start one with %mnb start (or mnb.controller.Pool.start())")
    return None


def set_current_pool(pool: "Pool | None") -> None:
    _CURRENT.clear()
    if pool is not None:
        _CURRENT.append(pool)


def set_last_run(records: list[dict[str, Any]]) -> None:
    """Gather the ranks' run records of the last training cell into ``mnb.last_run``."""
    from mnb.runs import Run

    _LAST_RUN.clear()
    _LAST_RUN.append(Run(records))
    peaks = [r["peak_flops"] for r in records if r.get("peak_flops") and str(r.get("device", "")).startswith("cpu")]
    if peaks:
        _CPU_PEAK["flops"] = min(peaks)


def measured_cpu_peak_flops() -> float | None:
    """The CPU ranks' measured GEMM peak from the last CPU training (per rank), if any."""
    return _CPU_PEAK.get("flops")


def last_run() -> Any:
    return _LAST_RUN[-1] if _LAST_RUN else None
