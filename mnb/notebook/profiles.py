"""Notebook side of profiling (torch-free): per-rank Kineto traces merged on one clock, ``mnb.last_profile``.

Why: torch writes one trace per rank, each on its own process's view; a viewer cannot put
ranks side by side (pytorch #128292).  :class:`Profile` reads a profile folder written by
:mod:`mnb.megatron.profile` (``trace/rank-N.trace.json``, ``meta/rank-N.json``) and writes
``merged.trace.json``: Chrome-trace JSON (Perfetto, ``chrome://tracing``) where each rank is
a process (``pid`` = rank) with its threads inside, every timestamp moved onto the host's
``time.perf_counter`` clock (the timeline's ``origin_s``; pinned by the rank's ``mnb.clock``
spans, as the traces' own clocks differ between processes) and counted from the earliest
event of any rank, and each collective on a row of its own, from its call to its completion (an async one
until its ``wait()``), named ``all_reduce tp 4.0 KiB``.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
from pathlib import Path
from typing import Any

from mnb.controller.registry import last_profile, set_last_profile  # noqa: F401 - kept importable here
from mnb.units import Text


MAX_TRACE_BYTES = 300 * 2**20
"""Per-rank traces larger than this in all are not merged (nor read into the kernel)."""

COMM_PREFIX = "mnb.comm "
STEP_PREFIX = "mnb.step "
CLOCK_PREFIX = "mnb.clock "
COMM_TID = 999_999_999
"""The thread row of each rank that holds its collectives from call to completion (async ones until
their ``wait()``), timed on the shared clock by the rank itself."""
ALIGNMENT_SLACK_US = 50.0
"""How far mnb's collective spans may sit from the profiler's operators around them: the spans are put on
the profiler's clock by the median offset of clock marks, a few microseconds off.  An autograd operator that
wraps a synchronous gloo all-reduce but appears to start just after it read as compute overlapping it (38-77 %
overlap in about 1 of 8 tp2 profiles, where gloo overlaps almost nothing)."""
_COMM_NAMES = ("gloo:", "nccl", "c10d::", "record_param_comms")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _clip(intervals, window):
    return _intersect(_union(intervals), [window])


def is_comm(event: dict[str, Any]) -> bool:
    name = str(event.get("name", ""))
    return event.get("cat") == "comm" or name.startswith(COMM_PREFIX) or name.startswith(_COMM_NAMES)


class Profile:
    """One profiled cell: ``.path`` (merged trace), ``.trace_dir`` (per-rank, HTA's layout),
    ``.summary()``, ``.table()``, ``.plot(range=None)``."""

    def __init__(self, folder: str | Path, max_bytes: int = MAX_TRACE_BYTES) -> None:
        self.folder = Path(folder)
        self.trace_dir = self.folder / "trace"
        self.path = self.folder / "merged.trace.json"
        files = sorted(self.trace_dir.glob("rank-*.trace.json"), key=lambda p: int(p.name.split("-")[1].split(".")[0]))
        if not files:
            raise FileNotFoundError(f"no per-rank traces in {self.trace_dir} (did the profiled cell run?)")
        self.trace_bytes = sum(p.stat().st_size for p in files)
        if self.trace_bytes > max_bytes:
            raise ValueError(f"the traces in {self.trace_dir} hold {_size(self.trace_bytes)}, over the "
                             f"{_size(max_bytes)} mnb reads; profile fewer steps (--profile 2) or ranks "
                             "(--profile-ranks 0), or open the per-rank files in Perfetto one by one")
        self.meta: dict[int, dict[str, Any]] = {}
        for rank_file in sorted((self.folder / "meta").glob("rank-*.json")):
            meta = json.loads(rank_file.read_text())
            self.meta[int(meta["rank"])] = meta
        self.events: list[dict[str, Any]] = []
        self.ranks: list[int] = []
        self._merge(files)

    # ----- merging
    def _merge(self, files: list[Path]) -> None:
        loaded = []
        for file in files:
            data = json.loads(file.read_text())
            rank = int(data.get("distributedInfo", {}).get("rank", file.name.split("-")[1].split(".")[0]))
            loaded.append((rank, data, self._offset(rank, data)))
        starts = [off + ev["ts"] / 1e6 for _, data, off in loaded for ev in data.get("traceEvents", [])
                  if ev.get("ph") == "X" and "ts" in ev]
        self.origin_s = min(starts) if starts else 0.0
        events: list[dict[str, Any]] = []
        for rank, data, offset in loaded:
            self.ranks.append(rank)
            events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
            for ev in data.get("traceEvents", []):
                if ev.get("ph") == "M":
                    if ev.get("name") == "thread_name":
                        events.append({**ev, "pid": rank})
                    continue
                if "ts" not in ev:
                    continue
                out = {**ev, "pid": rank, "ts": round((offset + ev["ts"] / 1e6 - self.origin_s) * 1e6, 3)}
                events.append(out)
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": COMM_TID,
                           "args": {"name": "collectives (call to completion)"}})
            for comm in self.meta.get(rank, {}).get("comms") or []:
                if comm.get("end_s") is None:
                    continue  # an async collective never waited for inside the profile
                events.append({"ph": "X", "cat": "comm", "pid": rank, "tid": COMM_TID,
                               "name": f"{comm['op']} {comm['group']} {_size(comm['bytes'])}",
                               "ts": round((comm["start_s"] - self.origin_s) * 1e6, 3),
                               "dur": round((comm["end_s"] - comm["start_s"]) * 1e6, 3),
                               "args": {k: comm[k] for k in ("op", "group", "bytes", "async")}})
        self.events = events
        self.path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                         "otherData": {"origin_perf_counter_s": self.origin_s,
                                                       "ranks": self.ranks}}))

    def _offset(self, rank: int, data: dict[str, Any]) -> float:
        """Seconds to add to ``ts / 1e6`` for ``time.perf_counter``: the median over the rank's clock marks."""
        marks = self.meta.get(rank, {}).get("clock_marks") or []
        ts = {int(str(e["name"])[len(CLOCK_PREFIX):]): e["ts"] / 1e6 for e in data.get("traceEvents", [])
              if str(e.get("name", "")).startswith(CLOCK_PREFIX)}
        diffs = sorted(marks[k] - t for k, t in ts.items() if k < len(marks))
        if diffs:
            return diffs[len(diffs) // 2]
        base_s = float(data.get("baseTimeNanoseconds", 0)) / 1e9  # the system clock, less exact
        return base_s + float(self.meta.get(rank, {}).get("perf_minus_wall_s", 0.0))

    # ----- reading
    def rank_events(self, rank: int) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("pid") == rank and e.get("ph") == "X"]

    def collectives(self, rank: int | None = None) -> list[dict[str, Any]]:
        """mnb's collective spans: ``name``, ``op``, ``group``, ``bytes``, ``rank``, ``start_us``, ``end_us``."""
        return [{"rank": e["pid"], "name": e["name"], "op": e["args"]["op"], "group": e["args"]["group"],
                 "bytes": e["args"]["bytes"], "start_us": e["ts"], "end_us": e["ts"] + e.get("dur", 0)}
                for e in self.events if e.get("cat") == "comm" and "op" in e.get("args", {})
                and (rank is None or e["pid"] == rank)]

    def steps(self, rank: int) -> list[tuple[float, float]]:
        """(start_us, end_us) of each profiled step of ``rank``; the whole trace for a whole-cell profile."""
        # the host's spans: on CUDA ranks Kineto copies each onto the GPU stream (gpu_user_annotation) too
        spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in self.rank_events(rank)
                 if str(e.get("name", "")).startswith(STEP_PREFIX) and e.get("cat") != "gpu_user_annotation"]
        if spans:
            return sorted(spans)
        events = self.rank_events(rank)
        return [(min(e["ts"] for e in events), max(e["ts"] + e.get("dur", 0) for e in events))] if events else []

    def _shares(self, rank: int) -> dict[str, float]:
        """Compute, communication and idle shares of the profiled steps, and how much communication overlaps
        compute.  An operator that starts a collective (up to :data:`ALIGNMENT_SLACK_US` after the collective's
        span, which mnb places on the profiler's clock by an estimated offset) is the collective's time."""
        events = self.rank_events(rank)
        windows = self.steps(rank)
        total = _length(windows)
        comm = _union([(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if is_comm(e)])
        comm_starts = sorted(a for a, _ in comm)
        compute = []
        for e in events:
            if e.get("cat") not in ("cpu_op", "kernel", "gpu_memcpy") or is_comm(e):
                continue
            start, end = e["ts"], e["ts"] + e.get("dur", 0)
            i = bisect.bisect_left(comm_starts, start - ALIGNMENT_SLACK_US)
            if i < len(comm_starts) and comm_starts[i] < end:
                continue  # an op around a collective (autograd's evaluate_function): its time is the collective's
            compute.append((start, end))
        compute = _union(compute)
        comm_w = _intersect(comm, windows)
        compute_w = _intersect(compute, windows)
        busy = _length(_intersect(_union(comm_w + compute_w), windows))
        comm_s, overlap = _length(comm_w), _length(_intersect(comm_w, compute_w))
        if total <= 0:
            return {"compute": 0.0, "communication": 0.0, "idle": 1.0, "overlap": 0.0}
        shares = {"compute": (busy - comm_s) / total, "communication": comm_s / total}
        shares["idle"] = max(0.0, 1.0 - shares["compute"] - shares["communication"])
        shares["overlap"] = overlap / comm_s if comm_s > 0 else 0.0
        return shares

    def _top(self, rank: int, k: int = 5) -> list[dict[str, Any]]:
        """Operators by self time (duration less their children's on the same thread) in the profiled steps."""
        windows = self.steps(rank)
        by_thread: dict[Any, list[dict[str, Any]]] = {}
        for e in self.rank_events(rank):
            # torch's own events (gloo's collectives are user annotations); not mnb's spans and rows
            if e.get("cat") in ("cpu_op", "kernel", "gpu_memcpy", "user_annotation") and \
                    not str(e.get("name", "")).startswith("mnb.") and e.get("tid") != COMM_TID:
                by_thread.setdefault(e.get("tid"), []).append(e)
        totals: dict[str, list[float]] = {}
        for evs in by_thread.values():
            evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
            stack: list[list[Any]] = []  # [end, name, self]
            for e in evs:
                end = e["ts"] + e.get("dur", 0)
                while stack and stack[-1][0] <= e["ts"]:
                    _close(stack.pop(), totals)
                if stack:
                    stack[-1][2] -= e.get("dur", 0)
                if any(a <= e["ts"] < b for a, b in windows):
                    stack.append([end, e["name"], e.get("dur", 0)])
                else:
                    stack.append([end, None, 0])
            while stack:
                _close(stack.pop(), totals)
        window = _length(windows) or 1.0
        rows = [{"rank": rank, "name": n, "calls": int(c), "self_us": round(t, 1), "share": t / window}
                for n, (t, c) in totals.items()]
        return sorted(rows, key=lambda r: -r["self_us"])[:k]

    def table(self, k: int = 10) -> list[dict[str, Any]]:
        """Rows (``rank``, ``name``, ``calls``, ``self_us``, ``share`` of the profiled steps), top ``k`` per rank."""
        return [row for rank in self.ranks for row in self._top(rank, k)]

    def shares(self) -> dict[int, dict[str, float]]:
        """Per rank: ``compute``, ``communication``, ``idle`` (summing to 1) and ``overlap`` (of communication)."""
        return {rank: self._shares(rank) for rank in self.ranks}

    def step_cost_s(self) -> dict[int, float]:
        """Per rank, mean seconds of a profiled step (with the profiler on)."""
        out = {}
        for rank, meta in self.meta.items():
            costs = [c["seconds"] for c in meta.get("step_costs") or []]
            if costs:
                out[rank] = sum(costs) / len(costs)
        return out

    def summary(self) -> Text:
        """Per rank the shares and top operators, the profiled step's cost and the trace's size (a str that
        shows as text as a cell's last value)."""
        lines = [f"profile of rank(s) {', '.join(map(str, self.ranks))}: {self.path} "
                 f"(per-rank traces {_size(self.trace_bytes)} in {self.trace_dir}; open the merged file in "
                 "https://ui.perfetto.dev)"]
        costs = self.step_cost_s()
        for rank, s in self.shares().items():
            cost = f", profiled step {costs[rank] * 1e3:.1f} ms" if rank in costs else ""
            lines.append(f"rank {rank}: compute {s['compute']:.0%}, communication {s['communication']:.0%} "
                         f"({s['overlap']:.0%} overlapped), idle {s['idle']:.0%}{cost}")
            for row in self._top(rank, 3):
                lines.append(f"    {row['name'][:60]:<60} {row['self_us'] / 1e3:8.2f} ms  x{row['calls']}")
        return Text("\n".join(lines))

    def __repr__(self) -> str:
        return self.summary()

    def memory(self) -> dict[int, dict[str, Any]]:
        """``--memory``: per rank, what it held over the profiled steps, by mnb's categories.

        ``{rank: {"times_ms", "weights", "gradients", "optimizer", "activations" (a list, one per
        time), "other" (CUDA: the allocator's bytes beyond the counted ones), "peak_bytes", "peak_ms",
        "snapshot" (CUDA: torch's memory snapshot for https://pytorch.org/memory_viz), "source"}}``.
        The peak has ``mnb.last_run.peak_memory_bytes``'s source and units: on CUDA ranks the allocator's
        bytes (replayed from the snapshot: ``max_memory_allocated`` of the profiled steps), on CPU ranks
        the counted tensors.
        """
        out = {}
        for rank, meta in sorted(self.meta.items()):
            mem = meta.get("memory")
            if not mem or not (mem.get("samples") or mem.get("allocated")):
                continue
            static = {k: int(mem["static"].get(k, 0)) for k in ("weights", "gradients", "optimizer")}
            base = sum(static.values())
            counted = [(t, int(a)) for t, a, _ in mem.get("samples") or []]
            if mem.get("allocated"):  # CUDA: the allocator's bytes, replayed from torch's memory snapshot
                times_s, totals = [t for t, _ in mem["allocated"]], [int(b) for _, b in mem["allocated"]]
                held = [_held_at(counted, t) for t in times_s]
                acts = [min(a, max(0, total - base)) for a, total in zip(held, totals)]
            else:  # CPU: mnb's counted tensors, as mnb.last_run's measured peak
                times_s, acts = [t for t, _ in counted], [a for _, a in counted]
                totals = [base + a for a in acts]
            other = [max(0, total - base - a) for a, total in zip(acts, totals)]
            totals = [base + a + o for a, o in zip(acts, other)]
            times = [round((t - self.origin_s) * 1e3, 3) for t in times_s]
            i = max(range(len(totals)), key=totals.__getitem__)
            out[rank] = {"times_ms": times, **static, "activations": acts, "other": other,
                         "peak_bytes": totals[i], "peak_ms": times[i], "snapshot": mem.get("snapshot"),
                         "source": mem.get("source")}
        return out

    def plot_memory(self, rank: int | None = None, predicted_peak_bytes: float | None = None):
        """Memory over the profiled steps of ``rank`` (default the first with --memory), stacked by
        category, the peak marked; ``predicted_peak_bytes`` (default ``mnb.last_run``'s prediction
        from mnb.estimate.memory for that rank, when there is one) as a dashed line.  Returns the figure
        (:func:`mnb.plot.profile.plot_profile_memory` draws it)."""
        from mnb.plot.profile import plot_profile_memory

        series = self.memory()
        if not series:
            raise ValueError("this profile has no memory over time: run the cell with --profile --memory")
        rank = next(iter(series)) if rank is None else rank
        if rank not in series:
            raise ValueError(f"rank {rank} has no memory series; ranks with one: {sorted(series)}")
        if predicted_peak_bytes is None:
            try:
                from mnb.controller import last_run

                run = last_run()
                predicted_peak_bytes = run.predicted_components(rank)["peak"] if run is not None else None
            except Exception:  # noqa: BLE001 - a prediction is a bonus, the measurement is the figure
                predicted_peak_bytes = None
        return plot_profile_memory(series[rank], rank, predicted_peak_bytes).figure

    def timeline_rows(self, range: tuple[float, float] | None) -> dict[tuple[int, Any], dict[str, list]]:  # noqa: A002
        """(rank, thread) -> ``{"compute": [(start_ms, ms)], "comm": [...]}`` of the events inside ``range``;
        only threads with an event there (gloo's ``pt_gloo_runloop`` threads hold none of their own)."""
        rows: dict[tuple[int, Any], dict[str, list]] = {}
        for e in self.events:
            if e.get("ph") != "X" or e.get("cat") not in ("cpu_op", "kernel", "comm", "gpu_memcpy"):
                continue
            start, dur = e["ts"] / 1e3, e.get("dur", 0) / 1e3
            if range and (start + dur < range[0] or start > range[1]):
                continue
            bars = rows.setdefault((e["pid"], e.get("tid")), {"compute": [], "comm": []})
            bars["comm" if is_comm(e) else "compute"].append((start, max(dur, 1e-4)))
        return rows

    def thread_names(self) -> dict[tuple[int, Any], str]:
        """(rank, thread) -> the thread's name as the trace records it."""
        return {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", "")) for e in self.events
                if e.get("ph") == "M" and e.get("name") == "thread_name"}

    def plot(self, range: tuple[float, float] | None = None):  # noqa: A002 - the issue's name
        """All ranks on one time axis (ms on the shared clock): one row per rank and thread with events in
        ``range``, collectives in red.  ``range``: (start_ms, end_ms); default the first profiled step of the
        first rank.  Returns the figure (:func:`mnb.plot.profile.plot_profile_timeline` draws it)."""
        from mnb.plot.profile import plot_profile_timeline

        if range is None:
            first = self.steps(self.ranks[0])[:1]
            range = (first[0][0] / 1e3, first[0][1] / 1e3) if first else None
        return plot_profile_timeline(self.timeline_rows(range), self.thread_names(), range).figure


def _held_at(samples: list[tuple[float, int]], t: float) -> int:
    """The counted activation bytes of the last sample at or before ``t`` (0 before the first)."""
    i = bisect.bisect_right([s for s, _ in samples], t)
    return samples[i - 1][1] if i else 0


def _close(entry: list[Any], totals: dict[str, list[float]]) -> None:
    _, name, self_time = entry
    if name is None:
        return
    total = totals.setdefault(name, [0.0, 0])
    total[0] += max(self_time, 0.0)
    total[1] += 1


# ----- the notebook's profiles (mnb.last_profile is the registry's, beside mnb.last_run)
def list_profiles(root: str | Path) -> list[dict[str, Any]]:
    """Profile folders under ``root``: ``path``, ``ranks``, ``bytes``, newest last."""
    out = []
    for folder in sorted(Path(root).glob("*/trace"), key=lambda p: p.stat().st_mtime):
        files = list(folder.glob("rank-*.trace.json"))
        out.append({"path": str(folder.parent), "ranks": len(files), "bytes": sum(f.stat().st_size for f in files)})
    return out


PROFILE_ENTRIES = ("trace", "meta", "memory", "merged.trace.json")
"""What a profile folder holds that mnb wrote (the ranks' ``trace/``, ``meta/``, ``memory/``; the merged trace)."""


def delete_profile(folder: str | Path) -> list[str]:
    """Delete what mnb wrote in the profile ``folder`` (:data:`PROFILE_ENTRIES`), and the folder when nothing
    else is in it; returns the other entries, which stay (a user's ``notes.txt``)."""
    folder = Path(folder)
    if not (folder / "trace").is_dir():
        raise ValueError(f"{folder} is not a profile folder (no trace/ inside); %mnb profile lists them")
    for name in PROFILE_ENTRIES:
        entry = folder / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif entry.exists() or entry.is_symlink():
            entry.unlink()
    kept = sorted(os.listdir(folder))
    if not kept:
        folder.rmdir()
    return kept
