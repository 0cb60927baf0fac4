"""Rank side of ``%%megatron --profile`` and ``mnb.train(..., profile=STEPS)``: torch.profiler
around chosen steps, on chosen ranks, written where Holistic Trace Analysis reads it.

Why a module of its own: the profiler must start and stop at step boundaries that only
``mnb.train`` knows, yet also cover a whole cell that does not train, and it must never
be left running after a cell that raised.  The worker wraps a profiled cell in
:func:`cell`; ``mnb.train`` calls :func:`train_steps` to say which of its steps run.

- Only the chosen ranks profile; the others run unchanged.  Nothing here runs a
  collective, so no rank ever waits on a profiled one (Megatron-LM PR #3273's stall).
- CPU activities, and CUDA on CUDA ranks; shapes, stacks and memory off (their cost
  is the trace's size).
- Each rank writes ``trace/rank-N.trace.json`` (torch's Kineto trace, with the
  ``distributedInfo`` block HTA takes the rank from; ``trace/`` holds nothing else, as
  HTA reads every file of its folder) and ``meta/rank-N.json``: the
  host's ``time.perf_counter`` (the timeline's ``origin_s``) at each ``mnb.clock K``
  span of the trace (so the merge can move the trace onto that clock), the profiled
  steps and their cost, and each collective's group (tp/pp/dp/cp/ep) and bytes,
  caught by wrapping ``torch.distributed``'s functions for the profiled steps only
  (gloo's trace events carry neither).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from mnb.profile_steps import parse_steps
from mnb.megatron.memory import allocated_over_time

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
               "reduce", "all_to_all_single", "send", "recv", "batch_isend_irecv",
               "_all_gather_base", "_reduce_scatter_base", "barrier")
"""``torch.distributed`` functions wrapped during profiled steps, so each call is a named span.
Not ``isend``/``irecv``: ``P2POp`` checks its op *is* one of them, so a wrapped one breaks
``batch_isend_irecv`` (Megatron's pipeline p2p path, ``batch_p2p_comm``), which is wrapped instead."""

COMM_PREFIX = "mnb.comm "
STEP_PREFIX = "mnb.step "
CLOCK_PREFIX = "mnb.clock "
KINETO_LOG_LEVEL = "6"
"""Kineto's log level on a rank that profiles (a user's own ``KINETO_LOG_LEVEL`` wins).  torch 2.13's Kineto
prints ``USDT: ... profiler_start``/``profiler_stop`` at every level up to 5 (and ``STAGE:`` lines at 3 and
below) into the cell's output; 6 silences it, Kineto's own error lines with it (checked on torch 2.13).
Kineto reads the variable once, at the process's first profiler, so it is set just before that."""


@dataclass
class Session:
    """One profiled cell (or call) on one rank."""

    out_dir: Path
    rank: int
    steps: tuple[int, int] | None
    profiled: bool
    prof: Any = None
    whole_cell: bool = False
    trained: bool = False
    step_costs: list[dict[str, float]] = field(default_factory=list)
    clock_marks: list[float] = field(default_factory=list)
    comms: list[dict[str, Any]] = field(default_factory=list)
    memory: bool = False
    memory_samples: list[list[Any]] = field(default_factory=list)
    snapshot: str | None = None
    allocated: list[list[float]] | None = None
    """CUDA, ``--memory``: ``[perf_counter_s, bytes]`` the allocator held over the profiled steps (replayed
    from torch's memory snapshot; its largest value is ``max_memory_allocated`` of those steps)."""
    done: bool = False
    _components: Any = None
    _saved: dict[str, Any] = field(default_factory=dict)
    _step_start: float = 0.0
    _step_range: Any = None

    # ----- the profiler
    def start(self) -> None:
        os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_LOG_LEVEL)  # no Kineto lines in the cell's output
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False,
                                           profile_memory=False)
        self.prof.__enter__()
        if self.memory and self._cuda():
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self.mark_clock()
        self._wrap_collectives()

    @staticmethod
    def _cuda() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    # ----- memory over time (--memory)
    def watch(self, components) -> None:
        """Follow mnb's counted tensors (:class:`~mnb.megatron.memory.ComponentMeter`) in the profiled steps."""
        if not (self.memory and self.profiled):
            return
        self._components = components
        components.always_count = True
        components.observer = self._memory_sample

    def _memory_sample(self, activations: int) -> None:
        if self.prof is not None and self._step_range is not None:
            allocated = int(torch.cuda.memory_allocated()) if self._cuda() else None
            self.memory_samples.append([time.perf_counter(), activations, allocated])

    def _memory_meta(self) -> dict[str, Any] | None:
        if not self.memory:
            return None
        static = {}
        if self._components is not None:  # ZeRO-3's weights: its shards and the buckets gathered at the peak
            static = {**self._components.static_bytes, "weights": self._components.weights_bytes()}
        return {"samples": self.memory_samples, "static": static, "snapshot": self.snapshot,
                "allocated": self.allocated, "source": "cuda" if self._cuda() else "counted tensors"}

    def mark_clock(self) -> None:
        """A ``mnb.clock K`` span with its host time: how the merge moves this trace onto ``perf_counter``.

        The trace's own clock (``baseTimeNanoseconds`` + ``ts``) is not the same for every process
        (measured: ranks of one host 2 ms apart), so each rank pins it here, at start and at each step.
        """
        before = time.perf_counter()
        with torch.profiler.record_function(f"{CLOCK_PREFIX}{len(self.clock_marks)}"):
            pass
        self.clock_marks.append((before + time.perf_counter()) / 2)

    def stop(self, keep: bool = True) -> None:
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        if self._step_range is not None:  # a step that raised
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        self._unwrap_collectives()
        prof.__exit__(None, None, None)
        if self.memory and self._cuda():
            if keep:
                (self.out_dir / "memory").mkdir(parents=True, exist_ok=True)
                self.snapshot = str(self.out_dir / "memory" / f"rank-{self.rank}.pickle")
                snapshot = torch.cuda.memory._snapshot()
                with open(self.snapshot, "wb") as file:  # for https://pytorch.org/memory_viz
                    pickle.dump(snapshot, file)
                self.allocated = allocated_over_time(snapshot, torch.cuda.current_device(),
                                                     time.perf_counter() - time.time())
            torch.cuda.memory._record_memory_history(enabled=None)
        if not keep:  # a warm-up dropped: what it noted goes with it
            self.comms.clear()
            self.clock_marks.clear()
            self.memory_samples.clear()
            return
        (self.out_dir / "trace").mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / "trace" / f"rank-{self.rank}.trace.json"))

    def write_meta(self, error: str | None = None) -> None:
        (self.out_dir / "meta").mkdir(parents=True, exist_ok=True)
        meta = {
            "rank": self.rank,
            "world_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1,
            "perf_minus_wall_s": time.perf_counter() - time.time(),
            "steps": list(self.steps) if self.steps else None,
            "whole_cell": self.whole_cell,
            "step_costs": self.step_costs,
            "clock_marks": self.clock_marks,
            "memory": self._memory_meta(),
            "comms": self.comms,
            "device": "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu",
            "error": error,
        }
        path = self.out_dir / "meta" / f"rank-{self.rank}.json"
        path.write_text(json.dumps(meta))

    # ----- mnb.train's steps
    def step_begin(self, index: int, step: int) -> None:
        """Before the call's ``index``-th step (from 1); ``step`` is the model's step count."""
        if not self.profiled or self.done or not self._chosen(index):
            return
        if self.prof is None:
            self.start()
        else:
            self.mark_clock()
        self._step_start = time.perf_counter()
        self._step_range = torch.profiler.record_function(f"{STEP_PREFIX}{step}")
        self._step_range.__enter__()

    def step_end(self, index: int, step: int) -> bool:
        """After the call's ``index``-th step: whether the profiler ran through it (then it was slowed)."""
        if not self.profiled or self.done or not self._chosen(index) or self.prof is None:
            return False
        self._step_range.__exit__(None, None, None)
        self._step_range = None
        self.step_costs.append({"step": step, "start_s": self._step_start,
                                "seconds": time.perf_counter() - self._step_start})
        if index == self._range()[1]:
            self.done = True  # a later training of the same cell runs unprofiled
            self.stop()
        return True

    def _range(self) -> tuple[int, int]:
        return self.steps or (2, 3)

    def past_the_end(self, steps: int) -> str:
        """Why a training call of ``steps`` steps would profile none of them ('' when it profiles some):
        said before any step, where a profile of nothing said nothing and kept the last cell's profile."""
        first, last = self._range()
        if self.done or first <= steps:
            return ""
        return (f"the profile's steps {first}-{last} start after this call's {steps} step(s), so nothing would be "
                f"profiled: name steps of this call (e.g. profile='{min(2, steps)}-{steps}' or --profile "
                f"{min(2, steps)}-{steps}), or train {first} steps or more")

    def _chosen(self, index: int) -> bool:
        first, last = self._range()
        return first <= index <= last

    # ----- collectives as named spans, with group and bytes
    def _wrap_collectives(self) -> None:
        dist = torch.distributed
        names = _group_names()
        for name in COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None or name in self._saved:
                continue
            self._saved[name] = original
            setattr(dist, name, _wrapped(self, name, original, names))

    def _unwrap_collectives(self) -> None:
        for name, original in self._saved.items():
            setattr(torch.distributed, name, original)
        self._saved.clear()


def _wrapped(session: Session, op: str, original, names: dict[Any, str]):
    def call(*args, **kwargs):
        group = kwargs.get("group")
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if op == "batch_isend_irecv":
            ops = args[0] if args else kwargs.get("p2p_op_list", [])
            tensors = [p.tensor for p in ops]
            group = getattr(ops[0], "group", None) if ops else None
        entry = {"op": op, "group": _group_label(group, names), "bytes": sum(t.numel() * t.element_size()
                                                                              for t in tensors),
                 "start_s": time.perf_counter(), "end_s": None, "async": bool(kwargs.get("async_op"))}
        with torch.profiler.record_function(f"{COMM_PREFIX}{op} {entry['group']} {entry['bytes']}B"):
            result = original(*args, **kwargs)
        session.comms.append(entry)
        if result is None or not (entry["async"] or op == "batch_isend_irecv"):
            entry["end_s"] = time.perf_counter()
            return result
        entry["async"] = True  # ends when its work is waited for: the window compute may overlap
        if isinstance(result, list):
            return [_Waited(w, entry) for w in result]
        return _Waited(result, entry)

    call.__wrapped__ = original
    return call


class _Waited:
    """An async collective's work, noting in its entry when ``wait()`` returned."""

    def __init__(self, work, entry: dict[str, Any]) -> None:
        self._work, self._entry = work, entry

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._entry["end_s"] = max(self._entry["end_s"] or 0.0, time.perf_counter())
        return out

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _group_names() -> dict[Any, str]:
    """Megatron's process groups of this rank by object and by ranks: tp, pp, dp, cp, ep."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return {}
    getters = [("tp", ps.get_tensor_model_parallel_group), ("pp", ps.get_pipeline_model_parallel_group),
               ("dp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
               ("dp", ps.get_data_parallel_group), ("cp", ps.get_context_parallel_group),
               ("ep", ps.get_expert_model_parallel_group)]
    names: dict[Any, str] = {}
    by_ranks: list[tuple[tuple[int, ...], str]] = []
    for label, getter in getters:
        try:
            group = getter()
            ranks = tuple(torch.distributed.get_process_group_ranks(group))
        except Exception:  # noqa: BLE001 - layout not set, or this group not built
            continue
        names.setdefault(id(group), label)
        by_ranks.append((ranks, label))
    # a group mnb does not know by object is named by its ranks; dp first, as one-rank groups are all alike
    # and DDP's gradient reduction is the one-rank collective a training runs
    for ranks, label in sorted(by_ranks, key=lambda item: item[1] != "dp"):
        names.setdefault(ranks, label)
    return names


def _group_label(group, names: dict[Any, str]) -> str:
    if group is None or group is torch.distributed.GroupMember.WORLD:
        return names.get(tuple(range(torch.distributed.get_world_size())), "world")
    if id(group) in names:
        return names[id(group)]
    try:
        return names.get(tuple(torch.distributed.get_process_group_ranks(group)), "other")
    except Exception:  # noqa: BLE001
        return "other"


_current: Session | None = None
_default_dir: Path | None = None
_written: Path | None = None
"""The folder this cell's profile went to (``_finish``), for the cell's reply."""


def current() -> Session | None:
    return _current


@contextlib.contextmanager
def cell(request: dict[str, Any] | None, rank: int,
         default_dir: str | os.PathLike | None = None) -> Iterator[dict[str, Any]]:
    """Around one cell (the worker): profile the cell's training steps, or the whole cell.

    ``request``: ``{"dir", "steps", "ranks", "memory"}`` from the notebook, or None (nothing is profiled
    unless ``mnb.train(profile=...)`` asks, into ``default_dir``).  Always leaves no profiler
    running and no collective wrapped, also when the cell raised.  After the cell the report's
    ``dir`` is the folder this rank wrote its profile to (absent when it wrote none): the reply
    carries it, so the notebook never has to guess which folder is the cell's.
    """
    global _current, _default_dir, _written
    _default_dir = Path(default_dir) if default_dir else None
    _written = None
    report: dict[str, Any] = {}  # the worker notes the cell's failure here (run_cell does not raise)
    if not request:
        try:
            yield report
        finally:
            _default_dir = None
            _note_written(report)
        return
    ranks = request.get("ranks")
    session = Session(out_dir=Path(request["dir"]), rank=rank, steps=parse_steps(request.get("steps")),
                      profiled=ranks is None or rank in ranks, memory=bool(request.get("memory")))
    _current = session
    if session.profiled:
        session.whole_cell = True  # until the cell trains
        session.start()
    error = None
    try:
        yield report
    except BaseException as exc:  # noqa: BLE001 - noted in the meta file, then raised as it was
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        _current, _default_dir = None, None
        try:
            _finish(session, error or report.get("error"))
        finally:
            _note_written(report)


def _note_written(report: dict[str, Any]) -> None:
    global _written
    if _written is not None:
        report["dir"] = str(_written)
    _written = None


def _finish(session: Session, error: str | None) -> None:
    global _written
    if not session.profiled:
        return
    try:
        session.stop(keep=session.whole_cell or bool(session.step_costs))
    finally:
        session._unwrap_collectives()
        session.write_meta(error)
        _written = session.out_dir


@contextlib.contextmanager
def train_steps(profile: Any) -> Iterator[Session | None]:
    """Around one ``mnb.train`` call: the session whose steps it profiles, or None.

    Inside a ``--profile`` cell, the cell's session (its whole-cell profile so far, a warm-up,
    is dropped); ``profile=STEPS`` in a plain cell profiles this call on every rank into the
    cell's folder under the pool's (``profiles/cell-ID``).
    """
    global _current
    session = _current
    if session is None and profile is None:
        yield None
        return
    steps = parse_steps(profile)  # a bad value fails here, on every rank, before any step
    own = session is None
    if own:
        if _default_dir is None:
            raise ValueError("mnb.train(profile=...) runs inside a %%megatron cell of a pool")
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        session = Session(out_dir=_default_dir, rank=rank, steps=steps, profiled=True)
        _current = session
    elif profile is not None:
        session.steps = steps
    if session.profiled and session.whole_cell:
        session.stop(keep=False)
        session.whole_cell = False
    session.trained = True
    error = None
    try:
        yield session
    except BaseException as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if own:
            _current = None
            _finish(session, error)
