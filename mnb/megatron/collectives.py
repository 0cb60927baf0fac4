"""Which collective this rank waits in: per process group, its call count and the calls not finished.

Why: a hang's Python stack says ``distributed_c10d.py in all_reduce`` on every rank, not *which*
all-reduce; a rank that skipped one waits in the next one of the same group, and the others are
elsewhere.  What tells them apart is each group's sequence number (collectives on one group pair up
by their order on it, not by where the code calls them) and, for point-to-point, the count per peer.

On gloo ranks (:func:`install`) mnb counts the calls itself, on the ``ProcessGroup`` class's methods
(``allreduce``, ``_allgather_base``/``all_gather_single``, ``send``, ``recv``, ...): every path
reaches them, also Megatron's import-time bindings (``dist_all_gather_func``) and
``batch_isend_irecv``, and ``torch.distributed.isend``/``irecv`` stay the functions ``P2POp``
compares by identity.  Each call is one integer increment and one small record holding a weak
reference to its ``Work``; a call counts as "in" until its work completed (an ``async_op=True``
call until ``wait()`` or, on gloo collectives, its completion).  On NCCL ranks PyTorch's Flight
Recorder keeps the same facts (``TORCH_FR_BUFFER_SIZE``, set by the pool's launcher):
:func:`snapshot` reads it instead.

:func:`snapshot` is called by the rank's I/O thread (the ``stacks`` answer) while the main thread
may be inside a collective: it only copies small lists and asks works whether they completed.
Its numbers count from the start of the rank's current cell or script (:func:`begin_cell`, called by
the worker as each ``execute`` begins): ``all_reduce #4`` is the cell's fourth on that group, the same
number on every rank of it, whatever earlier cells ran.  (The Flight Recorder's, on NCCL ranks, count
from the process group's creation.)  Plain data comes back (``mnb/controller/hangs.py`` reads it on the
notebook side)::

    {"source": "mnb", "groups": [{"key": "3", "name": "tp", "ranks": [0, 1], "calls": 43,
      "last": "all_reduce", "sent": {"1": 4}, "received": {}, "pending": [
        {"op": "all_reduce", "seq": 43, "shapes": [[4]], "dtype": "float32", "for_s": 2.1}]}]}
"""

from __future__ import annotations

import collections
import pickle
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

OPS = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
    "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor", "allgather_coalesced": "all_gather_coalesced",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "broadcast": "broadcast", "reduce": "reduce", "barrier": "barrier", "monitored_barrier": "monitored_barrier",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all_single", "all_to_all_single": "all_to_all_single",
    "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "recv_anysource": "recv",
}
"""``ProcessGroup`` method -> the ``torch.distributed`` name a user knows."""

PENDING_KEPT = 32
"""Unfinished calls remembered per group (more means async works never waited for)."""


class _Call:
    __slots__ = ("op", "seq", "peer", "shapes", "dtype", "started", "work", "returned")

    def __init__(self, op: str, seq: int, peer: int | None, shapes: list, dtype: str) -> None:
        self.op, self.seq, self.peer, self.shapes, self.dtype = op, seq, peer, shapes, dtype
        self.started = time.monotonic()
        self.work: Any = None  # weakref to the Work once the method returned
        self.returned = False

    def finished(self) -> bool:
        if not self.returned:
            return False
        work = self.work() if self.work is not None else None
        if work is None:
            return True  # no work, or dropped: nobody can wait on it
        try:
            return bool(work.is_completed())
        except Exception:  # noqa: BLE001 - a work that cannot say: count it as done
            return True


class _Group:
    __slots__ = ("group", "calls", "last", "sent", "received", "pending", "synchronous", "base", "__weakref__")

    def __init__(self, group) -> None:
        self.group = weakref.ref(group)
        self.synchronous = False
        """Collectives on this group finish before the call returns (:func:`complete_before_return`)."""
        self.calls = 0
        self.last = ""
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}
        self.pending: collections.deque[_Call] = collections.deque(maxlen=PENDING_KEPT)
        self.base: tuple[int, dict[int, int], dict[int, int]] = (0, {}, {})
        """``(calls, sent, received)`` when the current cell began (:func:`begin_cell`): what snapshots subtract."""


_groups: dict[int, _Group] = {}
_installed: dict[str, Any] = {}


def install() -> None:
    """Count every collective and p2p call of this process (gloo ranks; idempotent)."""
    cls = torch._C._distributed_c10d.ProcessGroup
    for method, op in OPS.items():
        original = getattr(cls, method, None)
        if original is None or method in _installed:
            continue
        _installed[method] = vars(cls).get(method, original)  # the descriptor itself, for uninstall
        setattr(cls, method, _counted(op, original))


def complete_before_return(group) -> None:
    """From now on every collective on ``group`` (gloo) has finished when its call returns, ``async_op=True`` too.

    Why: gloo runs an asynchronous collective on its own worker threads, reading and writing the
    tensors while the caller goes on; Megatron-FSDP keeps several all-gathers in flight on the dp
    group and resizes bucket storages around them, and on gloo ranks that crashed one rank in a few
    hundred ZeRO-3 steps (SIGABRT/SIGSEGV with the main thread in a coalesced reduce-scatter or in the
    loss: heap corruption).  Waiting at once gives the same results in the same order (collectives on a
    group pair up by their order, which does not change); only the overlap, which CPU ranks cannot
    use, is gone.  Point-to-point calls stay asynchronous (a send waited before its receive is posted
    could deadlock).  Counting must be installed (:func:`install`, idempotent) for this to act.
    """
    install()
    _state(group).synchronous = True


def begin_cell() -> None:
    """A cell or script begins on this rank: :func:`snapshot` counts from here (``counts`` still from the start)."""
    for state in list(_groups.values()):
        state.base = (state.calls, dict(state.sent), dict(state.received))


def uninstall() -> None:
    cls = torch._C._distributed_c10d.ProcessGroup
    for method, original in _installed.items():
        setattr(cls, method, original)
    _installed.clear()


def _state(group) -> _Group:
    state = _groups.get(id(group))
    if state is None or state.group() is not group:
        state = _groups[id(group)] = _Group(group)
    return state


def _counted(op: str, original):
    p2p = op in ("send", "recv")

    def call(self, *args, **kwargs):
        state = _state(self)
        tensors = _tensors(args[:2])
        peer = None
        if p2p:
            peer = _global_peer(self, args[1] if len(args) > 1 and isinstance(args[1], int) else None)
            counts = state.sent if op == "send" else state.received
            seq = counts[peer] = counts.get(peer, 0) + 1
        else:
            state.calls += 1
            seq = state.calls
        state.last = op
        record = _Call(op, seq, peer, [list(t.shape) for t in tensors[:4]],
                       str(tensors[0].dtype).removeprefix("torch.") if tensors else "")
        pending = state.pending
        while pending and pending[0].finished():
            pending.popleft()
        pending.append(record)
        try:
            work = original(self, *args, **kwargs)
            if work is not None and state.synchronous and not p2p:
                work.wait()
        finally:
            record.returned = True
        if work is not None:
            try:
                record.work = weakref.ref(work)
            except TypeError:
                pass
        return work

    call.__wrapped__ = original
    call.__name__ = getattr(original, "__name__", op)
    return call


def _tensors(args) -> list:
    found = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    found.append(item)
                elif isinstance(item, (list, tuple)):
                    found.extend(t for t in item if isinstance(t, torch.Tensor))
    return found


def _global_peer(group, group_rank: int | None) -> int:
    if group_rank is None:
        return -1  # recv from any source
    try:
        return dist.get_global_rank(group, group_rank)
    except Exception:  # noqa: BLE001 - the default group, or a group torch does not list
        return group_rank


# ----------------------------------------------------------------- names
GETTERS = ("tp", "pp", "dp", "cp", "ep")


def group_names() -> dict[str, str]:
    """Megatron's groups of this rank by their ``group_name``: tp, pp, dp (with cp), cp, ep; the
    default group is ``world``.  Read at report time: a group cached by rank set may be tp in one
    layout and pp in the next."""
    return {key: label for key, (label, _) in _known_groups().items()}


def _known_groups() -> dict[str, tuple[str, Any]]:
    known: dict[str, tuple[str, Any]] = {}
    try:
        world = dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001 - no process group yet
        return known
    known[world.group_name] = ("world", world)
    ps = sys.modules.get("megatron.core.parallel_state")  # never imported here: the I/O thread calls this
    if ps is None:
        return known
    getters = [("tp", ps.get_tensor_model_parallel_group), ("pp", ps.get_pipeline_model_parallel_group),
               ("dp", lambda: ps.get_data_parallel_group(with_context_parallel=True)),
               ("dp", ps.get_data_parallel_group), ("cp", ps.get_context_parallel_group),
               ("ep", ps.get_expert_model_parallel_group)]
    for label, getter in getters:
        try:
            group = getter()
        except Exception:  # noqa: BLE001 - layout not set, or this group not built
            continue
        key = getattr(group, "group_name", None)
        if key is not None and key not in known:
            known[key] = (label, group)
    return known


def _ranks(group) -> list[int]:
    try:
        return list(dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001
        return []


# -------------------------------------------------------------- snapshot
def snapshot() -> dict[str, Any] | None:
    """This rank's groups with activity in the current cell, their counts and unfinished calls, counted from
    the cell's start (:func:`begin_cell`); None before any group."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    if not _installed:
        return flight_recorder()
    names, now = group_names(), time.monotonic()
    groups = []
    for state in list(_groups.values()):
        group = state.group()
        base_calls, base_sent, base_received = state.base
        calls = state.calls - base_calls  # this cell's (begin_cell)
        sent = {p: n - base_sent.get(p, 0) for p, n in list(state.sent.items()) if n > base_sent.get(p, 0)}
        received = {p: n - base_received.get(p, 0) for p, n in list(state.received.items())
                    if n > base_received.get(p, 0)}
        if group is None or not (calls or sent or received):
            continue
        key = group.group_name

        def seq(call: _Call) -> int:
            if call.op == "send":
                return call.seq - base_sent.get(call.peer, 0)
            if call.op == "recv":
                return call.seq - base_received.get(call.peer, 0)
            return call.seq - base_calls

        pending = [{"op": c.op, "seq": seq(c), "peer": c.peer, "shapes": c.shapes, "dtype": c.dtype,
                    "for_s": round(now - c.started, 1)}
                   for c in list(state.pending) if not c.finished()]
        groups.append({"key": key, "name": names.get(key, "group"), "ranks": _ranks(group),
                       "calls": calls, "last": state.last,  # peers as str: the answer travels as JSON
                       "sent": {str(p): n for p, n in sent.items()},
                       "received": {str(p): n for p, n in received.items()}, "pending": pending})
    return {"source": "mnb", "groups": groups}


def flight_recorder() -> dict[str, Any] | None:
    """The same from PyTorch's Flight Recorder (NCCL ranks), or None when it records nothing."""
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    try:
        trace = pickle.loads(dump(True, False, False))  # collectives, no stack traces, all entries
    except Exception:  # noqa: BLE001 - not enabled, or no NCCL group
        return None
    known = _known_groups()
    return from_trace(trace, {key: label for key, (label, _) in known.items()},
                      {key: _ranks(group) for key, (_, group) in known.items()})


def from_trace(trace: dict[str, Any], names: dict[str, str],
               ranks_of: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """A Flight Recorder dump (``pickle.loads`` of ``_dump_nccl_trace()``) as :func:`snapshot`'s data;
    a group's ranks from the dump's ``pg_config``, else from ``ranks_of`` (this rank's groups)."""
    config = trace.get("pg_config") or {}
    groups: dict[str, dict[str, Any]] = {}
    for entry in trace.get("entries") or []:
        key = str((entry.get("process_group") or ("?",))[0])
        ranks = _parse_ranks(config.get(key, {}).get("ranks", "[]")) or (ranks_of or {}).get(key, [])
        group = groups.setdefault(key, {"key": key, "name": names.get(key, "group"),
                                        "ranks": ranks, "calls": 0, "last": "",
                                        "sent": {}, "received": {}, "pending": []})
        op = str(entry.get("profiling_name", "")).split(":", 1)[-1]
        op = FLIGHT_RECORDER_OPS.get(op, op)
        p2p = bool(entry.get("is_p2p"))
        seq = int(entry.get("p2p_seq_id" if p2p else "collective_seq_id") or 0)
        if not p2p and seq >= group["calls"]:
            group["calls"], group["last"] = seq, op
        if entry.get("state") != "completed" and not entry.get("retired"):
            sizes = entry.get("input_sizes") or []
            dtypes = entry.get("input_dtypes") or [""]
            group["pending"].append({"op": op, "seq": seq, "peer": None, "shapes": sizes[:4],
                                     "dtype": FLIGHT_RECORDER_DTYPES.get(str(dtypes[0]), str(dtypes[0]).lower()),
                                     "state": entry.get("state")})
    return {"source": "flight recorder", "groups": list(groups.values())}


FLIGHT_RECORDER_OPS = {"_all_gather_base": "all_gather_into_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
                       "allreduce_coalesced": "all_reduce_coalesced", "all_to_all": "all_to_all_single"}
"""The Flight Recorder's operation names (torch 2.11: ``nccl:_all_gather_base``) as :data:`OPS` spells them."""
FLIGHT_RECORDER_DTYPES = {"Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "Double": "float64",
                          "Int": "int32", "Long": "int64", "Byte": "uint8", "Char": "int8", "Bool": "bool"}
"""The Flight Recorder's dtype names (c10's ``ScalarType`` names) as torch spells them."""


def _parse_ranks(text: Any) -> list[int]:
    if isinstance(text, (list, tuple)):
        return [int(r) for r in text]
    return [int(r) for r in str(text).strip("[] ").split(",") if r.strip().lstrip("-").isdigit()]


def counts(group=None) -> dict[str, Any]:
    """This rank's calls on ``group`` (the default group when None) so far: ``{"calls": collectives,
    "sent": {peer: sends}, "received": {peer: receives}}`` (peers as global ranks)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    state = _groups.get(id(group))
    if state is None or state.group() is not group:
        return {"calls": 0, "sent": {}, "received": {}}
    return {"calls": state.calls, "sent": dict(state.sent), "received": dict(state.received)}
