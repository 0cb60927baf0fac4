"""``%mnb start|status|stop|restart``: the pool's lifecycle, as the notebook shows it.

Kept out of :mod:`mnb.notebook.magics` (parsing and dispatch only there): starting the pool from the
parsed flags (``--slurm`` ones included), the status table, stop and restart.  Torch-free.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from IPython.core.error import UsageError

from mnb.controller import Pool, set_current_pool
from mnb.controller import standby as standbys
from mnb.controller.repair import layout_kept
from mnb.notebook.parsers import parse_gpus
from mnb.units import format_bytes


def start_command(args: argparse.Namespace, existing: Pool | None) -> None:
    if existing is not None and existing.running:
        raise UsageError(f"a pool is already running ({existing!r}); %mnb stop or %mnb restart first")
    try:
        pool = Pool.start(
            ranks_per_node(args), device=args.device, gpus=parse_gpus(args.gpus) if args.gpus else None,
            timeout=args.timeout, cell_timeout=args.cell_timeout, grace=args.grace, nnodes=args.nnodes,
            rdzv_endpoint=args.rdzv_endpoint, bind_ip=args.ip, threads_per_rank=args.threads,
            extra_env={"MNB_VERBOSE": "1"} if args.verbose else {}, slurm=slurm_request(args),
            standby=args.standby,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    set_current_pool(pool)
    attach_live_progress(pool)
    print(format_table(
        ["rank", "pid", "host", "device", "backend"],
        [[i.rank, i.pid, i.host, i.device, i.backend] for i in sorted(pool.ranks.values(), key=lambda i: i.rank)],
    ))
    print(f"{pool.world_size} ranks ready in {pool.startup_s:.1f} s ({pool.start_note}); "
          f"layout {pool.layout.describe()}; standby {pool.standby_choice}")
    if args.timings:
        print(pool.start_timings or "no start-up timings: the ranks did not send them")


def status_command(args: argparse.Namespace, pool: Pool | None) -> None:
    if pool is None:
        parked = standbys.parked_status()
        print("no pool; start one with %mnb start" + ("" if parked is None else
              f" (it adopts the standby: {parked['state']}, host memory {format_bytes(parked['rss_bytes'])})"))
        return
    rows = pool.status()
    print(format_table(
        ["rank", "pid", "host", "state", "device", "memory", "coords"],
        [[r["rank"], r["pid"], r["host"], r["state"], r["device"], format_bytes(r["memory_bytes"]), r["coords"]]
         for r in rows],
    ))
    print(f"layout: {pool.layout.describe()}; {pool.world_size} x {pool.spec.device} ranks, {pool.state}")
    versions = sorted({(r["torch"], r["megatron"]) for r in rows if r.get("torch")})
    if versions:
        print("versions: " + "; ".join(f"torch {t}, megatron-core {m}" for t, m in versions))
    standby = pool.standby_status()
    if standby is not None:
        memory = format_bytes(standby["rss_bytes"]) if standby["rss_bytes"] is not None else "?"
        print(f"standby: {standby['state']}; pids {' '.join(map(str, standby['pids'])) or '-'} "
              f"(torchrun {standby['torchrun_pid']}); host memory {memory}")
    else:
        print(f"standby: none ({pool.standby_choice})")
    launch = pool.launch_description()
    if launch:
        print(launch)
    print(f"log: {pool.spec.log_file}")


def stop_command(args: argparse.Namespace, pool: Pool | None) -> None:
    if pool is None:
        print("no pool is running")
        return
    pool.stop()
    set_current_pool(None)
    print(f"stopped {pool.world_size} ranks")


def restart_command(args: argparse.Namespace, pool: Pool | None) -> None:
    if pool is None:
        raise UsageError("no pool to restart; use %mnb start")
    began = time.perf_counter()
    pool.restart()
    print(f"restarted: {pool.world_size} ranks ready in {time.perf_counter() - began:.1f} s ({pool.start_note}); "
          f"{layout_kept(pool.layout)} (a cell with layout flags changes it)")


def ranks_per_node(args: argparse.Namespace) -> int | None:
    """``-n``, or ``--ntasks-per-node`` (its Slurm spelling under --slurm); UsageError when they differ."""
    tasks = getattr(args, "ntasks_per_node", None)
    if tasks is None:
        return args.n
    if args.n is not None and args.n != tasks:
        raise UsageError(f"-n {args.n} and --ntasks-per-node {tasks} both give the ranks per node; keep one")
    return tasks


def slurm_request(args: argparse.Namespace) -> Any:
    """The SlurmRequest of ``%mnb start --slurm ...``, None without --slurm; UsageError for a stray Slurm flag."""
    given = [f"--{n.replace('_', '-')}" for n in ("nodes", "gpus_per_node", "ntasks_per_node", "partition", "time",
                                                 "account")
             if getattr(args, n) is not None] + (["--sbatch-arg"] if args.sbatch_arg else [])
    if not args.slurm:
        if given:
            raise UsageError(f"{', '.join(given)} only apply with --slurm (for hosts joined by hand use --nnodes)")
        return None
    from mnb.controller.slurm import SlurmRequest

    try:
        return SlurmRequest(nodes=1 if args.nodes is None else args.nodes, gpus_per_node=args.gpus_per_node,
                            partition=args.partition, time=args.time, account=args.account,
                            sbatch_args=tuple(args.sbatch_arg))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def attach_live_progress(pool: Pool) -> None:
    """The live training widget in a kernel; elsewhere the controller's text progress line stays."""
    try:
        from mnb.widgets.live import attach
    except ImportError:  # ipywidgets missing (a bare GPU image): keep the text line
        return
    attach(pool)


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
