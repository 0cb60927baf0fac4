"""Per-microbatch timeline of a training step, recorded through ``config.timers``.

Megatron's schedules call ``config.timers(name, log_level=...)`` and then
``.start()`` / ``.stop()`` around every forward and backward compute, every
p2p transfer and the grad all-reduce.  Megatron's own ``Timers`` synchronise
the GPU at each call and keep only totals; :class:`TimelineRecorder` keeps
every interval instead and never synchronises inside the step: CUDA events on
GPU (resolved once, after the step), ``time.perf_counter`` on CPU.

Ranks must share a clock for the bubble to mean anything: a stage's idle time
is measured against the whole pipeline's span.  Each row therefore carries
``origin_s``, the host's monotonic clock (``time.perf_counter``, one clock for
every process of a host) at the step's start, and its times are seconds from
there; on GPUs the origin event is recorded right after a synchronize (the
previous step already drained the queue), so event times and host time agree.
Before this, each rank's times started at its own step start, and ranks that
began a step at different moments showed one another's lag as bubble.

Which microbatch and virtual chunk an interval belongs to follows from call
order, because the schedules are deterministic:

- 1F1B (Narayanan et al. 2021, arXiv 2104.04473): forwards run microbatches
  0..m-1 in order, and so do backwards.
- interleaved 1F1B: Megatron's schedule table (``get_schedule_table``):
  microbatches in groups of ``microbatch_group_size_per_vp_stage`` (default
  pp), each group visiting chunks 0..v-1; backwards walk the same table with
  chunks reversed (v-1-chunk).

Usage::

    rec = TimelineRecorder(stage=pp_rank, num_microbatches=m, num_chunks=v, group_size=pp)
    config.timers = rec
    rec.begin_step(step)
    ... forward_backward_func(...) ...
    with rec.span("optimizer"):
        optimizer.step()
    rows = rec.end_step()   # [{"step", "stage", "chunk", "kind", "microbatch", "start_s", "end_s", "origin_s"}]
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Protocol

import torch

KIND = {"forward-compute": "forward", "backward-compute": "backward"}
"""Megatron timer names renamed in the timeline; other names are kept as they are."""

SKIP = frozenset({"forward-backward"})
"""Timers that span the whole schedule (the step itself); not timeline rows."""


def schedule_table(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) of each forward in an interleaved 1F1B step, in execution order."""
    table: list[tuple[int, int]] = []
    for first in range(0, num_microbatches, group_size):
        last = num_microbatches if first + group_size >= num_microbatches else first + group_size
        table.extend((mb, chunk) for chunk in range(num_chunks) for mb in range(first, last))
    return table


class _Clock:
    """Timestamps: CUDA events on GPU (resolved later), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.origin = None
        self.origin_host_s = 0.0

    def start(self) -> None:
        """Set the step's origin, on the host clock every rank of the host shares."""
        if self.cuda:
            torch.cuda.synchronize()
        self.origin = self.now()
        self.origin_host_s = time.perf_counter()

    def now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, stamp) -> float:
        if self.cuda:
            return self.origin.elapsed_time(stamp) / 1e3
        return stamp - self.origin


class ComputeListener(Protocol):
    """Told when a step begins, when each microbatch's forward starts and ends and when its
    backward ends (``key`` is its (microbatch, chunk)); :class:`mnb.megatron.memory.ComponentMeter` is one."""

    def step_started(self) -> None: ...

    def forward_started(self) -> None: ...

    def forward_stopped(self, key: object) -> None: ...

    def backward_stopped(self, key: object) -> None: ...


class _Timer:
    def __init__(self, recorder: "TimelineRecorder", name: str) -> None:
        self.recorder = recorder
        self.name = name
        self._start = None

    def start(self, barrier: bool = False) -> None:
        self._start = self.recorder.clock.now()
        if self.name == "forward-compute" and self.recorder.listener is not None:
            self.recorder.listener.forward_started()

    def stop(self, barrier: bool = False) -> None:
        if self._start is None:
            return
        self.recorder._close(self.name, self._start, self.recorder.clock.now())
        self._start = None

    # Megatron's Timer API, for code that asks for more than start/stop.
    def reset(self) -> None:
        self._start = None

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        return 0.0


class TimelineRecorder:
    """A ``config.timers`` replacement that keeps every interval of a step."""

    def __init__(
        self,
        *,
        stage: int,
        num_microbatches: int,
        num_chunks: int = 1,
        group_size: int | None = None,
        device: torch.device | str = "cpu",
        on_stop: Callable[[], None] | None = None,
        listener: "ComputeListener | None" = None,
    ) -> None:
        self.stage = stage
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        self.table = schedule_table(num_microbatches, num_chunks, group_size or 1)
        self.clock = _Clock(torch.device(device))
        self.on_stop = on_stop
        self.listener = listener
        self._counts = {"forward": 0, "backward": 0}
        self._timers: dict[str, _Timer] = {}
        self._raw: list[tuple[str, object, object]] = []
        self.step = 0

    def __call__(self, name: str, log_level: int | None = None) -> _Timer:
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = _Timer(self, name)
        return timer

    def _close(self, name: str, start, end) -> None:
        if name not in SKIP:
            self._raw.append((name, start, end))
        kind = KIND.get(name)
        if kind is not None and self.listener is not None:
            index = self._counts[kind]
            self._counts[kind] += 1
            key = self._locate(index, forward=kind == "forward")
            if kind == "forward":
                self.listener.forward_stopped(key)
            else:
                self.listener.backward_stopped(key)
        if self.on_stop is not None:
            self.on_stop()

    def begin_step(self, step: int) -> None:
        self.step = step
        self._raw = []
        self._counts = {"forward": 0, "backward": 0}
        for timer in self._timers.values():
            timer.reset()
        if self.listener is not None:
            self.listener.step_started()
        self.clock.start()

    @contextlib.contextmanager
    def span(self, kind: str):
        """Record the enclosed block as one interval of ``kind`` (no microbatch)."""
        start = self.clock.now()
        try:
            yield
        finally:
            self._close(kind, start, self.clock.now())

    def end_step(self) -> list[dict]:
        """Resolve this step's intervals into timeline rows (synchronises CUDA once)."""
        if self.clock.cuda:
            torch.cuda.synchronize()
        counts = {"forward": 0, "backward": 0}
        rows = []
        for name, start, end in self._raw:
            kind = KIND.get(name, name)
            chunk, microbatch = 0, None
            if kind in counts:
                k = counts[kind]
                counts[kind] += 1
                microbatch, chunk = self._locate(k, forward=kind == "forward")
            rows.append(
                {
                    "step": self.step,
                    "stage": self.stage,
                    "chunk": chunk,
                    "kind": kind,
                    "microbatch": microbatch,
                    "start_s": self.clock.seconds(start),
                    "end_s": self.clock.seconds(end),
                    "origin_s": self.clock.origin_host_s,
                }
            )
        self._raw = []
        return rows

    def _locate(self, k: int, *, forward: bool) -> tuple[int | None, int]:
        if k >= len(self.table):
            return None, 0
        microbatch, chunk = self.table[k]
        if not forward:
            chunk = self.num_chunks - 1 - chunk
        return microbatch, chunk


DISPATCH_METHODS = {"token_dispatch": "moe-dispatch", "token_combine": "moe-combine"}
"""MoE token-dispatcher methods that hold the expert all-to-all (forward direction), and
the timeline kind each one is recorded as."""


@contextlib.contextmanager
def time_token_dispatch(chunks, recorder: "TimelineRecorder"):
    """Record every MoE layer's forward dispatch and combine (the all-to-all) on the timeline.

    Megatron's token dispatchers do not go through ``config.timers``, so without this
    the expert all-to-all is invisible.  The dispatcher is a plain attribute of each
    MoE layer (not a module), so its bound methods are wrapped per instance for the
    duration of a ``train`` call and restored afterwards.  The backward all-to-all
    runs inside autograd and is not timed; it moves the same bytes.
    """
    wrapped: list[tuple[object, str]] = []
    for chunk in chunks:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is None:
                continue
            for method, kind in DISPATCH_METHODS.items():
                original = getattr(dispatcher, method, None)
                if original is None or method in vars(dispatcher):
                    continue

                def timed(*args, _original=original, _kind=kind, **kwargs):
                    with recorder.span(_kind):
                        return _original(*args, **kwargs)

                setattr(dispatcher, method, timed)
                wrapped.append((dispatcher, method))
    try:
        yield len(wrapped)
    finally:
        for dispatcher, method in wrapped:
            delattr(dispatcher, method)  # the class method shows through again

