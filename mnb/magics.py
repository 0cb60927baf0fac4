"""``%mnb`` and ``%%megatron``: parse, check, and hand over to the pool.

Line magic::

    %mnb start [-n N] [--device auto|cpu|cuda] [--gpus 0,1,..] [--timeout SECONDS]
               [--cell-timeout SECONDS] [--grace SECONDS] [--nnodes K] [--rdzv-endpoint HOST:PORT] [--ip 127.0.0.1]
    %mnb status          per rank: pid, state (idle/busy/restarting/dead), device, memory, layout
    %mnb stop            stop every rank; no process is left behind
    %mnb restart         stop and start the same pool (same size, device and GPUs)
    %mnb stacks          each rank's current Python stack (where is it stuck?)
    %mnb plot memory|timeline|mfu      plots of mnb.last_run, predicted beside measured
    %mnb plan --model PRESET --gpus N [--gpu h200] [--seq S] [--mbs M] [--gbs G]

Cell magic::

    %%megatron [--tp N] [--pp N] [--vpp N] [--cp N] [--ep N] [--sp/--no-sp]
               [--ranks 0,2-3] [--timeout SECONDS] [--grace SECONDS]
    model = mnb.gpt("tiny")
    print(rank, ps.get_tensor_model_parallel_rank())

Layout flags are sticky: a flag left out keeps the pool's current value, so
the cells after ``%%megatron --tp 2`` run under tp=2 until a cell asks for
another layout.  dp is always world_size / (tp * pp * cp).  The parallel state
is re-initialised in the live processes only when the layout changes.

Failures never need ``%mnb restart``: a rank that fails while the others wait
for it is shown at once and the others get ``--grace`` seconds; ranks that
cannot be released, or that died, are replaced in the background with the
same size, device and layout (see README, "When things go wrong").
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser

from mnb.config import ParallelConfig
from mnb.controller import Pool, current_pool, last_run, set_current_pool
from mnb.controller.pool import DEFAULT_GRACE_S
from mnb.controller.preflight import check_cell
from mnb.errors import interrupted


def parse_ranks(text: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3]; UsageError says what is wrong."""
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                if low > high:
                    raise UsageError(f"bad rank range {part!r}: {low} > {high}")
                ranks.update(range(low, high + 1))
            else:
                ranks.add(int(part))
        except ValueError:
            raise UsageError(f"bad rank list {text!r}: use numbers and ranges, e.g. 0,2-3") from None
    if not ranks or min(ranks) < 0:
        raise UsageError(f"bad rank list {text!r}: use non-negative numbers and ranges, e.g. 0,2-3")
    return sorted(ranks)


def parse_gpus(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"bad --gpus {text!r}: use GPU ids such as 0,1") from None


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError("must be positive")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError("must be zero or positive")
    return value


def _parser(prog: str, description: str) -> MagicArgumentParser:
    return MagicArgumentParser(prog=prog, description=description, add_help=False)


def start_parser() -> MagicArgumentParser:
    p = _parser("%mnb start", "Start N ranks through torchrun.")
    p.add_argument("-n", type=int, default=None, help="ranks (default: one per visible GPU, else 2 CPU ranks)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--gpus", default=None, help="GPU ids, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES)")
    p.add_argument("--timeout", type=_positive_float, default=180.0, help="seconds to wait for ranks to be ready")
    p.add_argument("--cell-timeout", type=_positive_float, default=None, help="default timeout of every cell")
    p.add_argument("--grace", type=_non_negative_float, default=DEFAULT_GRACE_S,
                   help="seconds the other ranks may take to finish a cell after one rank failed (default 3)")
    p.add_argument("--nnodes", type=int, default=1, help="torchrun nodes (others join with the printed command)")
    p.add_argument("--rdzv-endpoint", default=None, help="torchrun rendezvous HOST:PORT for several nodes")
    p.add_argument("--ip", default="127.0.0.1", help="interface the controller binds (default loopback only)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / ranks)")
    return p


def megatron_parser() -> MagicArgumentParser:
    defaults = ParallelConfig()
    p = _parser("%%megatron", "Run the cell on the ranks under a Megatron layout.")
    for name in ("tp", "pp", "vpp", "cp", "ep"):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{name} size (default: keep the pool's; initially {getattr(defaults, name) or 1})")
    p.add_argument("--sp", dest="sp", action="store_true", default=None, help="sequence parallel on")
    p.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallel off")
    p.add_argument("--ranks", default=None, help="run on these ranks only, e.g. 0,2-3")
    p.add_argument("--timeout", type=_positive_float, default=None, help="seconds before the cell is stopped")
    p.add_argument("--grace", type=_non_negative_float, default=None,
                   help="seconds the other ranks may take to finish after one rank failed (default: the pool's)")
    return p


def plan_parser() -> MagicArgumentParser:
    p = _parser("%mnb plan", "Predict memory and MFU for every valid layout.")
    p.add_argument("--model", required=True, help="model preset, e.g. llama-8b")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu", default="h200", help="GPU type from the hardware table")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--gbs", type=int, default=None)
    p.add_argument("--top", type=int, default=10, help="rows to show")
    return p


def requested_layout(current: ParallelConfig, args: Any, world_size: int) -> ParallelConfig:
    """The pool's layout with the flags given in this cell applied, dp re-derived."""
    changes = {name: getattr(args, name) for name in ("tp", "pp", "cp", "ep") if getattr(args, name) is not None}
    if args.vpp is not None:
        changes["vpp"] = None if args.vpp == 1 else args.vpp
    if args.sp is not None:
        changes["sequence_parallel"] = args.sp
    try:
        return replace(current, dp=None, **changes).resolve(world_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@magics_class
class MegatronMagics(Magics):
    """Parses magics and delegates to the pool; holds no transport code."""

    @line_magic
    def mnb(self, line: str) -> Any:
        """Manage the rank pool: %mnb start|status|stop|restart|stacks|plot|plan (see mnb.magics)."""
        words = shlex.split(line)
        if not words:
            raise UsageError("usage: %mnb start|status|stop|restart|stacks|plot|plan ... (see %mnb? )")
        command, rest = words[0], words[1:]
        handler = getattr(self, f"_cmd_{command}", None)
        if handler is None:
            raise UsageError(f"unknown %mnb command {command!r}; use start, status, stop, restart, stacks, plot or plan")
        return handler(rest)

    def _cmd_start(self, argv: list[str]) -> None:
        args = start_parser().parse_args(argv)
        existing = current_pool(required=False)
        if existing is not None and existing.running:
            raise UsageError(f"a pool is already running ({existing!r}); %mnb stop or %mnb restart first")
        try:
            pool = Pool.start(
                args.n, device=args.device, gpus=parse_gpus(args.gpus) if args.gpus else None,
                timeout=args.timeout, cell_timeout=args.cell_timeout, grace=args.grace, nnodes=args.nnodes,
                rdzv_endpoint=args.rdzv_endpoint, bind_ip=args.ip, threads_per_rank=args.threads,
            )
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        set_current_pool(pool)
        attach_live_progress(pool)
        print(format_table(
            ["rank", "pid", "host", "device", "backend"],
            [[i.rank, i.pid, i.host, i.device, i.backend] for i in sorted(pool.ranks.values(), key=lambda i: i.rank)],
        ))
        print(f"{pool.world_size} ranks ready in {pool.startup_s:.1f} s; layout {pool.layout.describe()}")

    def _cmd_status(self, argv: list[str]) -> None:
        pool = current_pool(required=False)
        if pool is None:
            print("no pool; start one with %mnb start")
            return
        rows = pool.status()
        print(format_table(
            ["rank", "pid", "host", "state", "device", "memory", "coords"],
            [[r["rank"], r["pid"], r["host"], r["state"], r["device"], format_bytes(r["memory_bytes"]), r["coords"]]
             for r in rows],
        ))
        print(f"layout: {pool.layout.describe()}  ({pool!r})")

    def _cmd_stop(self, argv: list[str]) -> None:
        pool = current_pool(required=False)
        if pool is None:
            print("no pool is running")
            return
        pool.stop()
        set_current_pool(None)
        print(f"stopped {pool.world_size} ranks")

    def _cmd_restart(self, argv: list[str]) -> None:
        pool = current_pool(required=False)
        if pool is None:
            raise UsageError("no pool to restart; use %mnb start")
        pool.restart()
        print(f"restarted: {pool.world_size} ranks ready in {pool.startup_s:.1f} s; layout {pool.layout.describe()}")

    def _cmd_stacks(self, argv: list[str]) -> None:
        for rank, text in sorted(current_pool().stacks().items()):
            print(f"--- rank {rank} ---\n{text}")

    def _cmd_plot(self, argv: list[str]) -> None:
        kinds = ("memory", "timeline", "mfu")
        if len(argv) != 1 or argv[0] not in kinds:
            raise UsageError(f"usage: %mnb plot {'|'.join(kinds)}")
        run = last_run()
        if run is None:
            raise UsageError("no run yet: train in a %%megatron cell with mnb.train(...) first")
        # Inside a kernel the figure is a pyplot one and shows itself inline.
        getattr(run, f"plot_{argv[0]}")()

    def _cmd_plan(self, argv: list[str]) -> None:
        args = plan_parser().parse_args(argv)
        from mnb.estimate import plan
        from mnb.plot import plot_plan

        try:
            rows = plan(args.model, args.gpus, gpu=args.gpu, seq=args.seq, mbs=args.mbs, gbs=args.gbs)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        from mnb.estimate import format_plan

        print(format_plan(rows[: args.top]))
        plot_plan(rows)

    @cell_magic
    def megatron(self, line: str, cell: str) -> None:
        """Run the cell on every rank (or --ranks) under the requested Megatron layout.

        Example::

            %%megatron --tp 2
            print(ps.get_tensor_model_parallel_rank())
        """
        args = megatron_parser().parse_args(shlex.split(line))
        pool = current_pool(required=False)
        if pool is None:
            raise UsageError("no pool is running; start one with %mnb start")
        layout = requested_layout(pool.layout, args, pool.world_size)
        ranks = parse_ranks(args.ranks) if args.ranks else None
        if ranks is not None and max(ranks) >= pool.world_size:
            raise UsageError(f"--ranks {args.ranks}: rank {max(ranks)} does not exist in world size {pool.world_size}")
        problems = check_cell(cell, layout)
        if problems:
            raise UsageError("refused before running on the ranks:\n  " + "\n  ".join(problems))
        try:
            pool.run(cell, ranks=ranks, timeout=args.timeout, layout=layout, show_result=True, grace=args.grace)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt as exc:
            if hasattr(exc, "_render_traceback_"):  # the pool's one-line account of the interrupt
                raise
            raise interrupted("interrupted in the notebook kernel after the ranks had finished the cell") from None
        if pool.last_cell_records:
            print(last_run().summary())


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


def format_bytes(value: int | None) -> str:
    if value is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)


def register(ipython: Any) -> None:
    ipython.register_magics(MegatronMagics(ipython))


def unregister(ipython: Any) -> None:
    magics = ipython.magics_manager.magics
    magics["line"].pop("mnb", None)
    magics["cell"].pop("megatron", None)
