"""``%mnb`` and ``%%megatron``: parse, check, and hand over to the pool.

Line magic (``%mnb COMMAND --help``, ``-h`` or ``%mnb COMMAND?`` prints one
command's flags with their defaults and an example; ``%mnb?`` prints them all)::

    %mnb start [-n N] [--device auto|cpu|cuda] [--gpus 0,1,..] [--timeout SECONDS] [--cell-timeout SECONDS]
               [--grace SECONDS] [--nnodes K] [--rdzv-endpoint HOST:PORT] [--ip 127.0.0.1] [--threads T] [--verbose]
               [--timings] [--standby off|on|auto]
    %mnb status          per rank: pid, state (idle/busy/restarting/dead), device, memory, layout; the standby
    %mnb stop            stop every rank; no process is left behind
    %mnb restart         stop and start the same pool (same size, device, GPUs and layout)
    %mnb stacks          each rank's Python stack and the collective it waits in (where is it stuck?)
    %mnb debug [RANK]    post-mortem pdb where a rank's last cell failed (default: the root cause)
    %mnb plot memory|timeline|mfu|loss plots of mnb.last_run, predicted beside measured
    %mnb run [--ranks R] [--timeout S] [--grace S] [--isolated] SCRIPT [ARGS...]   a torchrun script, unmodified
    %mnb plan --model PRESET|PATH --gpus N [--gpu h200] [--seq S] [--mbs M] [--gbs G] [--top K] [--calibrate]
    %mnb start --slurm --nodes N [--gpus-per-node G | --ntasks-per-node N] [--partition P] [--time T] [--account A] [--sbatch-arg ARG]
    %mnb export [megatron-lm|torchrun|slurm] [--nodes N] [--gpus-per-node G] [-o FILE] [--model PRESET] ...
    %mnb profile [list|open|delete] [FOLDER|all]       the profiles of %%megatron --profile

Cell magic (``%%megatron?`` or ``%%megatron --help`` prints its flags)::

    %%megatron [--tp N] [--pp N] [--vpp N] [--cp N] [--ep N] [--sp/--no-sp] [--fsdp [STRATEGY]]
               [--ranks 0,2-3] [--timeout SECONDS] [--grace SECONDS] [--debug-ranks 0,2-3]
               [--profile [STEPS]] [--profile-ranks 0,2-3] [--memory] [-o DIR]
    model = mnb.gpt("tiny")
    print(rank, ps.get_tensor_model_parallel_rank())

A cell means the same every time it runs: a cell that names any layout flag
(--tp --pp --vpp --cp --ep --sp/--no-sp --fsdp) runs under exactly that layout, the
dimensions it does not name being 1 and sequence parallelism and FSDP off; a cell that
names none keeps the pool's current layout (``%mnb restart`` keeps it too).  So ``%%megatron --pp 2`` after
``%%megatron --tp 2`` on 2 ranks runs under tp1 pp2.  dp is always
world_size / (tp * pp * cp).  The parallel state is re-initialised in the live
processes only when the layout changes.

Cells run where the notebook is: in the kernel's directory (``%cd`` is followed) on
every host that has that folder, with the kernel's environment changes (``%env``).

Failures never need ``%mnb restart``: a rank that fails while the others wait
for it is shown at once and the others get ``--grace`` seconds; ranks that
cannot be released, or that died, are replaced in the background with the
same size, device and layout (see docs/playbook.md, "When things go wrong").
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import replace
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from mnb.config import FSDP_OPTIM_ON_CPU, ParallelConfig
from mnb.controller import Pool, current_pool, last_run
from mnb.controller.preflight import cell_settings, check_cell
from mnb.controller.registry import remember_settings
from mnb.notebook.debug_commands import debug_command, stacks_command
from mnb.notebook.help import before_script, help_end_transformer, mnb_help, mnb_overview, wants_help
from mnb.notebook.parsers import (LAYOUT_FLAGS, MNB_COMMANDS, SUBCOMMAND_PARSERS, layout_from_flags,
                                  megatron_parser, parse_ranks)
from mnb.notebook.plan_commands import export_command, plan_command
from mnb.notebook.pool_commands import restart_command, start_command, status_command, stop_command
from mnb.notebook.profile_commands import profile_request, run_profile_command, take_profile
from mnb.notebook.run_commands import kernel_changes, pool_request, require_pool, run_command

__all__ = ["LAYOUT_FLAGS", "MNB_COMMANDS", "SUBCOMMAND_PARSERS", "MegatronMagics", "help_end_transformer",
           "megatron_parser", "parse_ranks", "register", "requested_layout", "unregister"]
"""What others import from here (the extension, the tests).  The flags are in .parsers, the help in .help,
each command in its own module of this package (.pool_commands, .run_commands, .debug_commands, .plan_commands,
.profile_commands); this module parses the line and dispatches."""


def requested_layout(current: ParallelConfig, args: Any, world_size: int) -> ParallelConfig:
    """The layout a ``%%megatron`` cell runs under, dp derived from ``world_size``.

    A cell that names any layout flag gets exactly that layout: the dimensions it
    does not name are 1, vpp is plain 1F1B and sequence parallelism is off.  A
    cell that names none keeps ``current``.  So a cell means the same whatever
    ran before it: ``--pp 2`` after ``--tp 2`` is tp1 pp2.
    """
    try:
        named = layout_from_flags(args)
        return (named or replace(current, dp=None)).resolve(world_size)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


@magics_class
class MegatronMagics(Magics):
    """Parses magics and delegates to the pool; holds no transport code."""

    @line_magic
    def mnb(self, line: str) -> Any:
        """Manage the rank pool: %mnb start|status|stop|restart|stacks|plot|plan|run (replaced by mnb_help())."""
        words = shlex.split(line, comments=True)
        if not words or words[0].rstrip("?") in ("", "-h", "--help", "help"):
            if len(words) > 1 and words[0] == "help":  # %mnb help start
                words = [words[1], "--help"]
            else:
                print(mnb_overview())
                return None
        command, rest = words[0], words[1:]
        if command.endswith("?"):  # %mnb start? reached here without the input transformer
            command, rest = command.rstrip("?"), rest + ["--help"]
        make_parser = SUBCOMMAND_PARSERS.get(command)
        if make_parser is None:
            raise UsageError(f"unknown %mnb command {command!r}; use {', '.join(MNB_COMMANDS)} (%mnb --help)")
        parser = make_parser()
        if wants_help(before_script(rest) if command == "run" else rest):
            print(parser.format_help())
            return None
        if command == "start" and rest and rest[0].isdigit():  # ipcluster's habit, and a user trial's first try
            raise UsageError(f"%mnb start takes the number of ranks as a flag: %mnb start -n {rest[0]}"
                             + "".join(f" {w}" for w in rest[1:]))
        args = parser.parse_args(rest)
        return getattr(self, f"_cmd_{command}")(args, current_pool(required=False))

    # Each command lives in its own module and is handed the pool (None: no pool runs); these names
    # are what ``mnb()`` dispatches to.
    def _cmd_start(self, args: argparse.Namespace, pool: Pool | None) -> None:
        start_command(args, pool)

    def _cmd_status(self, args: argparse.Namespace, pool: Pool | None) -> None:
        status_command(args, pool)

    def _cmd_stop(self, args: argparse.Namespace, pool: Pool | None) -> None:
        stop_command(args, pool)

    def _cmd_restart(self, args: argparse.Namespace, pool: Pool | None) -> None:
        restart_command(args, pool)

    def _cmd_stacks(self, args: argparse.Namespace, pool: Pool | None) -> None:
        stacks_command(args, pool)

    def _cmd_debug(self, args: argparse.Namespace, pool: Pool | None) -> None:
        debug_command(args, pool)

    def _cmd_profile(self, args: argparse.Namespace, pool: Pool | None) -> None:
        run_profile_command(args, pool)

    def _cmd_plot(self, args: argparse.Namespace, pool: Pool | None) -> None:
        run = last_run()
        if run is None:
            raise UsageError("no run yet: train in a %%megatron cell with mnb.train(...) first")
        # Inside a kernel the figure is a pyplot one and shows itself inline.
        getattr(run, f"plot_{args.kind}")()

    def _cmd_run(self, args: argparse.Namespace, pool: Pool | None) -> None:
        run_command(args, pool)

    def _cmd_export(self, args: argparse.Namespace, pool: Pool | None) -> None:
        export_command(args)

    def _cmd_plan(self, args: argparse.Namespace, pool: Pool | None) -> None:
        plan_command(args, pool)

    @cell_magic
    def megatron(self, line: str, cell: str) -> None:
        """Run the cell on the ranks under a Megatron layout (replaced by megatron_parser().format_help())."""
        parser = megatron_parser()
        argv = shlex.split(line, comments=True)
        if wants_help(argv):
            print(parser.format_help())
            return
        args = parser.parse_args(argv)
        pool = require_pool(current_pool(required=False))
        layout = requested_layout(pool.layout, args, pool.world_size)
        if layout.fsdp == "optim" and pool.spec.device == "cpu":
            raise UsageError(FSDP_OPTIM_ON_CPU)
        ranks = parse_ranks(args.ranks, pool.world_size)
        problems = check_cell(cell, layout)
        if problems:
            raise UsageError("refused before running on the ranks:\n  " + "\n  ".join(problems))
        profile = profile_request(args, pool)
        debug_ranks = parse_ranks(args.debug_ranks, pool.world_size, "--debug-ranks")
        try:
            with pool_request("cell"):
                # the display ranks show the cell's result; no rank sends its value, which nothing here reads
                pool.run(cell, ranks=ranks, timeout=args.timeout, layout=layout, show_result=True, want_value=False,
                         grace=args.grace, kernel=kernel_changes(pool), profile=profile, debug_ranks=debug_ranks)
        finally:
            shown = take_profile(pool.last_cell_profile or (profile["dir"] if profile else None))
        if pool.last_cell_records:  # the ranks' record of what the cell trained: mnb.last_run, %mnb export
            print(last_run().summary())
        else:  # a cell that trained nothing: its literal mnb.gpt(...) is what %mnb export takes
            remember_settings(**cell_settings(cell))
        if shown is not None:
            print(shown.summary())


# What %mnb? and %%megatron? show: generated from the parsers, never a hand-written copy.
MegatronMagics.mnb.__doc__ = mnb_help()
MegatronMagics.megatron.__doc__ = megatron_parser().format_help()


def register(ipython: Any) -> None:
    """Register the magics and the ``%mnb start?`` input transformer (idempotent)."""
    ipython.register_magics(MegatronMagics(ipython))
    cleanup = ipython.input_transformers_cleanup
    if help_end_transformer not in cleanup:
        cleanup.append(help_end_transformer)


def unregister(ipython: Any) -> None:
    magics = ipython.magics_manager.magics
    magics["line"].pop("mnb", None)
    magics["cell"].pop("megatron", None)
    cleanup = ipython.input_transformers_cleanup
    if help_end_transformer in cleanup:
        cleanup.remove(help_end_transformer)
