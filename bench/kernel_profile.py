"""Where a training step's GPU time goes: kernels grouped by kind (run on a rank).

    from kernel_profile import profile_step
    table = profile_step(model, micro_batch_size=8, global_batch_size=64, bf16=True)

Profiles one ``mnb.train`` step with ``torch.profiler`` (CUDA activity) and
groups the kernels' self time: GEMMs, attention, Triton (mnb's / Megatron's
compiled fusions), norms, copies and casts, other elementwise and reductions,
NCCL.  ``busy_share`` is kernel time over the step's wall time (what is left
is the GPU waiting on the host); :func:`idle_gaps` says where in the step it waits.
"""

from __future__ import annotations

import re
import time

CATEGORIES = [
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attention|attn"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_"),
    ("triton", r"^triton_"),
    ("norm", r"norm"),
    ("copy/cast", r"copy|memcpy|memset|cat_|CatArray|to_copy|fill"),
    ("reduce", r"reduce|softmax|max_|sum_"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
]


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label
    return "other"


def idle_gaps(prof, least_us: float = 20.0, top: int = 12) -> dict:
    """Where the GPU waits inside the profiled span: the time from the first kernel's start to the last one's
    end (``kernel_span_s``; the rest of ``wall_s`` is the call's set-up before its first kernel and after its
    last), the gaps of at least ``least_us`` between kernels in it (``gaps_s``), and the largest of them with
    the kernels on either side (what the GPU finished, what it waited for)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return {"kernel_span_s": 0.0, "gaps_s": 0.0, "largest_gaps": []}
    gaps, end, before = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start - end >= least_us:
            gaps.append((start - end, before, name))
        if stop > end:  # kernels of several streams overlap: the span so far ends at the latest end
            end, before = stop, name
    return {"kernel_span_s": round((end - spans[0][0]) / 1e6, 4),
            "gaps_s": round(sum(g for g, _, _ in gaps) / 1e6, 4),
            "largest_gaps": [(round(g / 1e3, 3), a[:70], b[:70]) for g, a, b in sorted(gaps, reverse=True)[:top]]}


def profile_step(model, **train_kw) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import mnb

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        mnb.train(model, steps=1, **train_kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = getattr(event, "self_cuda_time_total", 0.0)
        if us > 0:
            kernels[event.key] = kernels.get(event.key, 0.0) + us / 1e6
    groups: dict[str, float] = {}
    for name, seconds in kernels.items():
        groups[category(name)] = groups.get(category(name), 0.0) + seconds
    busy = sum(groups.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {
        **idle_gaps(prof),
        "wall_s": round(wall, 4),
        "kernel_s": round(busy, 4),
        "busy_share": round(busy / wall, 3),
        "groups_s": {k: round(v, 4) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_kernels": [(name[:110], round(s, 4), category(name)) for name, s in top],
    }
