"""Which collective each rank waits in, and what that says across ranks: pure functions.

The ranks send plain data with their ``stacks`` answer (``mnb.megatron.collectives.snapshot``:
per process group its mnb name, member ranks, call count, the last operation, p2p counts per peer
and the calls not finished).  Here it becomes one line per waiting call::

    all_reduce #43 of tp group [0,1], tensor [4] float32, for 3.0 s

and a diagnosis across ranks, one line per group that cannot go on::

    rank 1 is at all_reduce #42 of tp group [0,1]; rank 0 is at #43 — rank 1 skipped one (or rank 0 ran one more)
    rank 0 is in all_reduce, rank 1 in all_gather_into_tensor of tp group [0,1] (#7 on both)
    rank 1 is in recv #5 from rank 0 of pp group [0,1]; rank 0 has sent 4 — rank 0 skipped a send (or rank 1 receives one more)

A rank that ended the cell with an exception did not skip anything: given the ranks that raised
(``raised``), the line says so::

    rank 0 waits in all_reduce #4 of world group [0,1]; rank 1 raised ValueError after all_reduce #3

Collectives of one group pair up by their order on it (its sequence number), whatever code calls
them; sends and receives pair up per peer.  So a rank whose count on a group is behind the others'
skipped a call (or they ran one more), and ranks in calls with the same number but different
operations are in a mismatch.

Only calls that have waited :data:`SETTLED_S` or more say so.  Ranks that are still running (a cell
past its timeout in the middle of healthy training) answer at different moments, each a fraction
of a second into some call, and their counts differ without anything being skipped.
"""

from __future__ import annotations

from typing import Any

Snapshot = dict[str, Any]
SETTLED_S = 1.0
"""How long a call must have waited before the diagnosis reads anything into it (a Flight Recorder
entry, which has no waited time, counts as settled)."""


def _settled(call: dict[str, Any] | None) -> bool:
    return call is not None and (call.get("for_s") is None or call["for_s"] >= SETTLED_S)


def group_text(group: dict[str, Any]) -> str:
    """``tp group [0,1]``"""
    return f"{group.get('name', 'group')} group [{','.join(str(r) for r in group.get('ranks', []))}]"


def call_text(call: dict[str, Any], group: dict[str, Any]) -> str:
    """``all_reduce #43 of tp group [0,1], tensor [4] float32, for 3.0 s`` (``recv #5 from rank 0 of ...``)."""
    op, peer = call.get("op", "?"), call.get("peer")
    text = f"{op} #{call.get('seq')}"
    if peer is not None and op in ("send", "recv"):
        text += f" {'to' if op == 'send' else 'from'} {'any rank' if peer == -1 else f'rank {peer}'}"
    text += f" of {group_text(group)}"
    shapes = call.get("shapes") or []
    if shapes:
        shown = " ".join(f"[{', '.join(str(d) for d in shape)}]" for shape in shapes[:2])
        text += f", tensor {shown}{' ...' if len(shapes) > 2 else ''} {call.get('dtype', '')}".rstrip()
    if call.get("for_s") is not None:
        text += f", for {call['for_s']:.1f} s"
    elif call.get("state"):
        text += f", {call['state']}"
    return text


def waiting_in(snapshot: Snapshot | None) -> list[str]:
    """Each call this rank has not finished, oldest first (normally one)."""
    if not snapshot:
        return []
    return [call_text(call, group) for group in snapshot.get("groups", []) for call in group.get("pending", [])]


def diagnose(snapshots: dict[int, Snapshot | None], raised: dict[int, str] | None = None) -> list[str]:
    """One line per group whose members cannot all go on, from every answering rank's snapshot.

    ``raised``: rank -> exception name, for the ranks that ended the cell with an exception (a rank
    behind the others because it raised is said to have raised, not to have skipped a call)."""
    raised = raised or {}
    by_rank = {rank: {g["key"]: g for g in (snap or {}).get("groups", [])}
               for rank, snap in snapshots.items() if snap}
    lines: list[str] = []
    seen: set[str] = set()
    for rank in sorted(by_rank):
        for key, group in by_rank[rank].items():
            if not group.get("pending"):
                continue
            if key not in seen:
                seen.add(key)
                line = _collective_line(key, group, by_rank, raised)
                if line:
                    lines.append(line)
            for call in group["pending"]:
                line = _p2p_line(rank, call, key, group, by_rank, raised)
                if line and line not in lines:
                    lines.append(line)
    return lines


def _first_collective(group: dict[str, Any] | None) -> dict[str, Any] | None:
    calls = [c for c in (group or {}).get("pending", []) if c.get("op") not in ("send", "recv")]
    return min(calls, key=lambda c: c.get("seq", 0)) if calls else None


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(str(r) for r in ranks)}"


def _raised(ranks: list[int], raised: dict[int, str]) -> str:
    """``rank 1 raised ValueError``, ``ranks 1,3 raised ValueError``, ``ranks 1,3 raised KeyError, ValueError``"""
    names = sorted({raised[r] for r in ranks})
    return f"{_who(ranks)} raised {', '.join(names)}"


def _collective_line(key: str, group: dict[str, Any], by_rank: dict[int, dict[str, Any]],
                     raised: dict[int, str]) -> str:
    members = [r for r in group.get("ranks", []) if r in by_rank]
    if not any(_first_collective(by_rank[r].get(key)) for r in members):
        return ""
    name = group_text(group)
    position, op = {}, {}
    for r in members:
        mine = by_rank[r].get(key)
        pending = _first_collective(mine)
        position[r] = pending["seq"] if pending else (mine or {}).get("calls", 0)
        op[r] = pending["op"] if pending else (mine or {}).get("last", "")
    values = sorted(set(position.values()))
    if len(values) == 1:
        ops = sorted(set(op.values()))
        if len(ops) == 1 or not all(_settled(_first_collective(by_rank[r].get(key))) for r in members):
            return ""
        parts = [f"{_who([r for r in members if op[r] == o])} {'is ' if i == 0 else ''}in {o}"
                 for i, o in enumerate(sorted(ops, key=lambda o: min(r for r in members if op[r] == o)))]
        return f"{', '.join(parts)} of {name} (#{values[0]} on {'both' if len(members) == 2 else 'all'})"
    low, high = values[0], values[-1]
    behind = [r for r in members if position[r] == low]
    ahead = [r for r in members if position[r] == high]
    if not all(_settled(_first_collective(by_rank[r].get(key))) for r in ahead):
        return ""  # the ranks ahead have only just entered their call: they may all be running
    if all(r in raised for r in behind):  # they ended the cell with an exception: nothing was skipped
        waits = "waits" if len(ahead) == 1 else "wait"
        their = "its" if len(behind) == 1 else "their"
        after = f"after {op[behind[0]]} #{low}" if low else f"before {their} first call on it"
        return f"{_who(ahead)} {waits} in {op[ahead[0]]} #{high} of {name}; {_raised(behind, raised)} {after}"
    missing = high - low
    one = "one" if missing == 1 else str(missing)
    verb = "is" if len(behind) == 1 else "are"
    where = f"{verb} at {op[behind[0]]} #{low} of {name}" if low else f"made no call on {name}"
    return (f"{_who(behind)} {where}; {_who(ahead)} {'is' if len(ahead) == 1 else 'are'} at "
            f"{'' if low else op[ahead[0]] + ' '}#{high} — {_who(behind)} skipped {one} (or {_who(ahead)} ran {one} more)")


def _p2p_line(rank: int, call: dict[str, Any], key: str, group: dict[str, Any],
              by_rank: dict[int, dict[str, Any]], raised: dict[int, str]) -> str:
    op, peer, seq = call.get("op"), call.get("peer"), call.get("seq", 0)
    if op not in ("send", "recv") or peer is None or peer < 0 or peer not in by_rank or not _settled(call):
        return ""
    theirs = by_rank[peer].get(key) or {}
    name = group_text(group)
    if op == "recv":
        sent = (theirs.get("sent") or {}).get(str(rank), 0)
        if sent >= seq:
            return ""
        if peer in raised:
            return (f"rank {rank} is in recv #{seq} from rank {peer} of {name}; "
                    f"{_raised([peer], raised)} after sending {sent}")
        return (f"rank {rank} is in recv #{seq} from rank {peer} of {name}; rank {peer} has sent {sent} — "
                f"rank {peer} skipped a send (or rank {rank} receives one more)")
    received = (theirs.get("received") or {}).get(str(rank), 0)
    if received >= seq:
        return ""
    if peer in raised:
        return (f"rank {rank} is in send #{seq} to rank {peer} of {name}; "
                f"{_raised([peer], raised)} after receiving {received}")
    return (f"rank {rank} is in send #{seq} to rank {peer} of {name}; rank {peer} has received {received} — "
            f"a send without a matching recv (rank {peer} skipped a recv, or rank {rank} sends one more)")


def report_lines(snapshots: dict[int, Snapshot | None], ranks: list[int], labels: dict[int, str]) -> list[str]:
    """``[r0 tp0 pp0 dp0] in all_reduce #43 of ...`` for each of ``ranks``, then the diagnosis lines."""
    lines = [f"[{labels.get(r, f'r{r}')}] in {text}" for r in ranks for text in waiting_in(snapshots.get(r))]
    return lines + diagnose(snapshots)
