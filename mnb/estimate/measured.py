"""Turn a machine measurement into a device entry of the hardware table (``%mnb plan --calibrate``).

The measurement is plain data from :func:`mnb.megatron.calibrate.measure`
(or ``bench/gemm_sweep.py --json``): GEMM FLOP/s per ``(m, n, k)``, the copy
bandwidth, the all-reduce bus bandwidth.  What it replaces:

- ``gemm_curve``: each GEMM's rate over the device's peak at its effective size
  ``3/(1/m+1/n+1/k)`` (the best rate where sizes repeat); on CPU ranks the peak
  itself is the best measured rate (a CPU has no datasheet peak that holds);
- ``hbm_bytes_per_s``: the measured copy bandwidth (``memory_efficiency``, how
  far elementwise kernels fall short of it, stays the table's);
- ``intra_efficiency`` (or ``inter_efficiency`` when the ranks span nodes): the
  measured all-reduce bus bandwidth over the table's link bandwidth.

Every replaced number's source names the measurement.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

from . import hardware


def _base_for(device_name: str) -> str:
    dev = hardware.device_from_name(device_name)
    if dev is None:
        raise ValueError(f"measured device {device_name!r} is not in the hardware table; "
                         f"register it first (mnb.estimate.hardware.register('name', base='h200', ...))")
    return dev.name


def register_measurement(measurement: dict[str, Any], *, name: str | None = None,
                         base: str | None = None) -> hardware.Device:
    """Register ``measurement`` as a device (default name: '<base>-calibrated') and return it."""
    try:
        gemms = [(float(m), float(n), float(k), float(rate)) for m, n, k, rate in measurement["gemm"]]
        copy_bw = float(measurement["copy_bytes_per_s"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("a measurement needs 'gemm' [[m, n, k, flop_per_s], ...] and 'copy_bytes_per_s' "
                         "(what mnb.megatron.calibrate.measure() returns)") from None
    if not gemms or copy_bw <= 0 or any(min(g) <= 0 for g in gemms):
        raise ValueError(f"the measurement has no usable GEMM rates or bandwidth: {measurement!r}")
    base = base or _base_for(str(measurement.get("device_name", "")))
    parent = hardware.device(base)
    on_cpu = parent.name == "cpu"
    peak = max(rate for *_, rate in gemms) if on_cpu else parent.bf16_flops
    best: dict[float, float] = {}
    for m, n, k, rate in gemms:
        d = round(3.0 / (1.0 / m + 1.0 / n + 1.0 / k), 1)
        best[d] = max(best.get(d, 0.0), min(1.0, rate / peak))
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    what = (f"measured by %mnb plan --calibrate on {measurement.get('device_name', base)} "
            f"({measurement.get('world_size', 1)} rank(s), {when})")
    numbers: dict[str, Any] = {"gemm_curve": tuple(sorted(best.items())), "hbm_bytes_per_s": copy_bw}
    if on_cpu:  # measured: no longer the nominal placeholder
        numbers.update(bf16_flops=peak, fp32_flops=peak, nominal=False)
    bus = measurement.get("allreduce_bus_bytes_per_s")
    if bus:
        if measurement.get("intra_node", True):
            numbers["intra_efficiency"] = min(1.0, float(bus) / parent.intra_node_bytes_per_s)
        else:
            numbers["inter_efficiency"] = min(1.0, float(bus) / parent.inter_node_bytes_per_s)
    key = name or f"{parent.name}-calibrated"
    label = "CPU ranks (calibrated here)" if on_cpu else f"{parent.label} (calibrated here)"
    return hardware.register(key, base=parent.name, label=label, source=what, **numbers)


def describe(dev: hardware.Device) -> str:
    """One line per calibrated number, with its source."""
    curve = ", ".join(f"{d:g}:{f:.0%}" for d, f in dev.gemm_curve)
    lines = [f"{dev.label}: peak {dev.bf16_flops / 1e12:,.3g} TFLOP/s",
             f"  GEMM efficiency by effective size: {curve}",
             f"  memory bandwidth {dev.hbm_bytes_per_s / 1e9:,.1f} GB/s",
             f"  collective efficiency: intra-node {dev.intra_efficiency:.0%}, inter-node {dev.inter_efficiency:.0%}",
             f"  source: {dev.source_of('gemm_curve')}"]
    return "\n".join(lines)
