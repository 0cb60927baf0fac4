"""``%mnb`` and ``%%megatron``: parse, check, and hand over to the pool.

Line magic (``%mnb COMMAND --help``, ``-h`` or ``%mnb COMMAND?`` prints one
command's flags with their defaults and an example; ``%mnb?`` prints them all)::

    %mnb start [-n N] [--device auto|cpu|cuda] [--gpus 0,1,..] [--timeout SECONDS] [--cell-timeout SECONDS]
               [--grace SECONDS] [--nnodes K] [--rdzv-endpoint HOST:PORT] [--ip 127.0.0.1] [--threads T] [--verbose]
               [--timings] [--standby off|on|auto]
    %mnb status          per rank: pid, state (idle/busy/restarting/dead), device, memory, layout; the standby
    %mnb stop            stop every rank; no process is left behind
    %mnb restart         stop and start the same pool (same size, device and GPUs)
    %mnb stacks          each rank's Python stack and the collective it waits in (where is it stuck?)
    %mnb debug [RANK]    post-mortem pdb where a rank's last cell failed (default: the root cause)
    %mnb plot memory|timeline|mfu|loss plots of mnb.last_run, predicted beside measured
    %mnb run [--ranks R] [--timeout S] [--grace S] [--isolated] SCRIPT [ARGS...]   a torchrun script, unmodified
    %mnb plan --model PRESET|PATH --gpus N [--gpu h200] [--seq S] [--mbs M] [--gbs G] [--top K] [--calibrate]
    %mnb start --slurm --nodes N [--gpus-per-node G] [--partition P] [--time T] [--account A] [--sbatch-arg ARG]
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
names none keeps the pool's current layout.  So ``%%megatron --pp 2`` after
``%%megatron --tp 2`` on 2 ranks runs under tp1 pp2.  dp is always
world_size / (tp * pp * cp).  The parallel state is re-initialised in the live
processes only when the layout changes.

Failures never need ``%mnb restart``: a rank that fails while the others wait
for it is shown at once and the others get ``--grace`` seconds; ranks that
cannot be released, or that died, are replaced in the background with the
same size, device and layout (see docs/playbook.md, "When things go wrong").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import time
from dataclasses import replace
from typing import Any, Callable, Iterator

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser, MagicHelpFormatter

from mnb.config import FSDP_OPTIM_ON_CPU, FSDP_STRATEGIES, ParallelConfig
from mnb.controller import Pool, current_pool, last_run, set_current_pool
from mnb.controller import standby as standbys
from mnb.controller.kernel_context import kernel_context
from mnb.controller.preflight import cell_settings, check_cell
from mnb.controller.registry import remember_settings
from mnb.errors import RequestRefused, interrupted
from mnb.profile_commands import profile_request, run_profile_command, take_profile
from mnb.timeouts import DEFAULT_GRACE_S, START_TIMEOUT_S
from mnb.units import format_bytes


def _kernel(pool: Any, *, cwd: bool) -> dict[str, Any] | None:
    """The kernel's cwd (scripts) and environment changes since the pool started, for the ranks."""
    since = getattr(pool, "environ_at_start", None)
    return kernel_context(since, cwd=cwd) if since is not None else None


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


LAYOUT_FLAGS = ("tp", "pp", "vpp", "cp", "ep", "sp", "fsdp")
"""The %%megatron flags that name a layout: a cell naming any of them runs under exactly that layout."""

MNB_COMMANDS = ("start", "status", "stop", "restart", "stacks", "debug", "plot", "plan", "run", "export", "profile")


class _HelpFormatter(MagicHelpFormatter):
    """IPython's magic help layout with a plain ``usage:`` line and every option's default."""

    def add_usage(self, usage, actions, groups, prefix="usage: "):  # type: ignore[override]
        argparse.RawDescriptionHelpFormatter.add_usage(self, usage, actions, groups, prefix)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            return text
        if action.required:
            return text + " (required)"
        return text + " (default: %(default)s)"


def _parser(prog: str, description: str, examples: list[str]) -> MagicArgumentParser:
    """A parser whose ``format_help()`` is the command's help: flags, defaults, examples."""
    epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples)
    return MagicArgumentParser(prog=prog, description=description, epilog=epilog,
                               formatter_class=_HelpFormatter, add_help=True)


def start_parser() -> MagicArgumentParser:
    p = _parser("%mnb start", "Start N ranks through torchrun and print rank, pid, host, device and backend.", [
        "%mnb start                      # one rank per visible GPU, else 2 CPU ranks",
        "%mnb start -n 2 --device cpu --cell-timeout 600",
        "%mnb start -n 8 --device cuda --nnodes 2 --rdzv-endpoint node0:29400 --ip 0.0.0.0",
        "%mnb start --slurm --nodes 2 --gpus-per-node 8 --partition gpu --time 2:00:00 --ip 0.0.0.0",
    ])
    p.add_argument("-n", type=int, default=None, metavar="N",
                   help="ranks on this host (default: one per visible GPU, else 2 CPU ranks)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is visible, else cpu with gloo")
    p.add_argument("--gpus", default=None, metavar="0,1,..",
                   help="GPU ids, sets CUDA_VISIBLE_DEVICES (default: every visible GPU)")
    p.add_argument("--timeout", type=_positive_float, default=START_TIMEOUT_S, metavar="SECONDS",
                   help="seconds to wait for the ranks to be ready")
    p.add_argument("--cell-timeout", type=_positive_float, default=None, metavar="SECONDS",
                   help="default timeout of every cell (default: none)")
    p.add_argument("--grace", type=_non_negative_float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="seconds the other ranks may take to finish a cell after one rank failed")
    p.add_argument("--nnodes", type=int, default=1, metavar="K",
                   help="torchrun nodes; the others join with the printed command")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="torchrun rendezvous for several nodes (default: this host:29400 when --nnodes > 1)")
    p.add_argument("--ip", default="127.0.0.1",
                   help="interface the controller binds; 0.0.0.0 lets ranks on other hosts connect")
    p.add_argument("--threads", type=int, default=None, metavar="T",
                   help="CPU threads per rank (default: cores / ranks)")
    p.add_argument("--verbose", action="store_true", default=False,
                   help="show known third-party warnings (Megatron, torch, the TE/apex fallbacks) in the cells; "
                        "by default they go to the pool's log, mnb.pool().spec.log_file (default: off)")
    p.add_argument("--timings", action="store_true", default=False,
                   help="print where the start's seconds went, stage by stage, for the rank ready last "
                        "(torchrun, interpreter, torch, CUDA, process group, Megatron-Core, mnb; default: off)")
    p.add_argument("--standby", default="auto", choices=["off", "on", "auto"],
                   help="keep the next ranks launched ahead, imports done, so restarts adopt them; auto: on for "
                        "CUDA pools, for CPU pools only with cores and memory to spare (default: auto)")
    _slurm_arguments(p)
    return p


def _slurm_arguments(p: MagicArgumentParser) -> None:
    """``%mnb start --slurm``: the ranks as one Slurm job (mnb/controller/slurm.py)."""
    g = p.add_argument_group("slurm (the ranks run as one job on an allocation; docs/several-machines.md)")
    g.add_argument("--slurm", action="store_true", default=False,
                   help="submit one Slurm job whose tasks run torchrun and join this pool (default: off)")
    g.add_argument("--nodes", type=int, default=None, metavar="N", help="nodes of the job (default: 1 with --slurm)")
    g.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="GPUs, and ranks, per node (default: none: CPU ranks, -n per node)")
    g.add_argument("--partition", default=None, metavar="P", help="Slurm partition (default: the cluster's)")
    g.add_argument("--time", default=None, metavar="T", help="Slurm time limit, e.g. 2:00:00 (default: the partition's)")
    g.add_argument("--account", default=None, metavar="A", help="Slurm account (default: yours)")
    g.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="a further sbatch option, repeatable: --sbatch-arg=--qos=debug (default: none)")


def status_parser() -> MagicArgumentParser:
    return _parser("%mnb status", "Per rank: pid, host, state (idle/busy/restarting/dead), device, memory in use "
                   "and coordinates; then the layout, the Slurm job and its state (--slurm pools) and the pool's "
                   "log file. Answers also while a cell runs.",
                   ["%mnb status"])


def stop_parser() -> MagicArgumentParser:
    return _parser("%mnb stop", "Stop every process of the pool (torchrun, the ranks and what they started) "
                   "and remove the pool's folder with its secret.", ["%mnb stop"])


def restart_parser() -> MagicArgumentParser:
    return _parser("%mnb restart", "Stop and start the same pool (same size, device, GPUs and flags) "
                   "without restarting the Jupyter kernel; names defined in cells are gone.", ["%mnb restart"])


def stacks_parser() -> MagicArgumentParser:
    return _parser("%mnb stacks", "Print every rank's current Python stack and the collective it waits in "
                   "(operation, group, sequence number, tensor), then what the ranks' counts say "
                   "(where is it stuck?); answers also while a cell runs.", ["%mnb stacks"])


def debug_parser() -> MagicArgumentParser:
    p = _parser("%mnb debug", "Post-mortem pdb on the frame where a rank's last cell failed, like IPython's "
                "%debug; prompts and answers go through the notebook's stdin, labelled with the rank. A rank "
                "keeps its failure until its next cell, and only while its process lives.", [
                    "%mnb debug        # the root cause (first failure) of the last failed cell",
                    "%mnb debug 1      # rank 1's last failure",
                ])
    p.add_argument("rank", nargs="?", type=int, default=None, metavar="RANK",
                   help="the rank to debug (default: the root-cause rank of the last failed cell)")
    return p


def plot_parser() -> MagicArgumentParser:
    p = _parser("%mnb plot", "Plot mnb.last_run, predicted beside measured.", [
        "%mnb plot timeline      # measured 1F1B Gantt per stage, bubble vs (p-1)/(m+p-1)",
        "%mnb plot memory        # predicted beside measured, per component and rank",
        "%mnb plot mfu",
        "%mnb plot loss          # training loss and evaluation loss (eval_every=) per step",
    ])
    p.add_argument("kind", choices=["memory", "timeline", "mfu", "loss"], help="which plot of mnb.last_run")
    return p


def megatron_parser() -> MagicArgumentParser:
    defaults = ParallelConfig()
    p = _parser(
        "%%megatron",
        "Run the cell on the ranks (all by default) under a Megatron layout.\n\n"
        "A cell that names any layout flag (--tp --pp --vpp --cp --ep --sp/--no-sp --fsdp) runs under exactly\n"
        "that layout: the dimensions it does not name are 1, sequence parallelism and FSDP are off.\n"
        "A cell that names none keeps the pool's current layout.  dp = world size / (tp * pp * cp).  The names rank,\n"
        "world_size, local_rank, device, torch, dist, ps (megatron.core.parallel_state), mnb and display\n"
        "are bound on every rank; names a cell defines persist for later cells.",
        [
            "%%megatron --tp 2                 # tp2 pp1, dp = world / 2",
            "model = mnb.gpt('tiny')",
            "",
            "%%megatron --pp 2                 # tp1 pp2 (unnamed dimensions are 1), whatever ran before",
            "%%megatron                        # no layout flag: the pool's current layout",
            "%%megatron --tp 2 --sp --ranks 0,1 --timeout 60",
            "%%megatron --fsdp                 # Megatron-FSDP, ZeRO-3 (--fsdp optim_grads: ZeRO-2)",
        ],
    )
    sizes = p.add_argument_group("layout (naming any of these sets the whole layout)")
    names = {"tp": "tensor-parallel size", "pp": "pipeline-parallel size",
             "vpp": "virtual pipeline stages per rank (interleaved 1F1B; needs --pp 2 or more)",
             "cp": "context-parallel size (long sequences; TE attention when installed, else mnb's)", "ep": "expert-parallel size (MoE models)"}
    for name, what in names.items():
        sizes.add_argument(f"--{name}", type=int, default=None, metavar="N",
                           help=f"{what} (default: {getattr(defaults, name) or 1} when the cell names "
                                "another layout flag; the pool's when it names none)")
    sizes.add_argument("--sp", dest="sp", action="store_true", default=None,
                       help="sequence parallelism on (default: off when the cell names another layout flag; "
                            "the pool's when it names none)")
    sizes.add_argument("--no-sp", dest="sp", action="store_false",
                       help="sequence parallelism off (default: see --sp)")
    sizes.add_argument("--fsdp", nargs="?", const="optim_grads_params", default=None, choices=FSDP_STRATEGIES,
                       metavar="{" + ",".join(FSDP_STRATEGIES) + "}",
                       help="Megatron-FSDP over the dp ranks: shard the optimizer state (optim, ZeRO-1), and the "
                            "gradients (optim_grads, ZeRO-2), and the parameters (optim_grads_params, ZeRO-3; "
                            "--fsdp alone); not with --pp, optim not on CPU ranks (default: off when the cell names another layout flag; "
                            "the pool's when it names none)")
    run = p.add_argument_group("running")
    run.add_argument("--ranks", default=None, metavar="0,2-3", help="run on these ranks only (default: every rank)")
    run.add_argument("--timeout", type=_positive_float, default=None, metavar="SECONDS",
                     help="seconds before the cell is stopped (default: the pool's --cell-timeout, else none)")
    run.add_argument("--grace", type=_non_negative_float, default=None, metavar="SECONDS",
                     help="seconds the other ranks may take to finish after one rank failed "
                          f"(default: the pool's --grace, {DEFAULT_GRACE_S:g} s unless %%mnb start set it)")
    run.add_argument("--debug-ranks", default=None, metavar="0,2-3",
                     help="only these ranks stop at breakpoint() and pdb.set_trace(); the others skip them "
                          "(default: every rank, served one after another in rank order)")
    profile_arguments(p)
    return p


def profile_arguments(p: MagicArgumentParser) -> None:
    """``%%megatron``'s profiling flags (mnb.megatron.profile, mnb.profiles)."""
    prof = p.add_argument_group("profiling (mnb.last_profile; docs/magics.md)")
    prof.add_argument("--profile", nargs="?", const="", default=None, metavar="STEPS",
                      help="torch.profiler on the ranks for steps STEPS of the cell's training, e.g. 3-4 "
                           "(default: its 2nd and 3rd steps, or the whole cell when it does not train)")
    prof.add_argument("--profile-ranks", default=None, metavar="0,2-3",
                      help="profile these ranks only; the others run unprofiled (default: every rank)")
    prof.add_argument("--memory", action="store_true", default=False,
                      help="with --profile: memory over the profiled steps by component (mnb.last_profile.plot_memory()); "
                           "on CUDA ranks also torch's memory snapshot (memory/rank-N.pickle)")
    prof.add_argument("-o", "--output", default=None, metavar="DIR",
                      help="write the profile folder under DIR (default: the pool's folder, removed with the pool)")


def profile_parser() -> MagicArgumentParser:
    p = _parser("%mnb profile", "List, open or delete the profiles of %%megatron --profile (mnb.last_profile).", [
        "%mnb profile                  # the pool's profile folders, newest last",
        "%mnb profile open             # the last profile's merged trace, for https://ui.perfetto.dev",
        "%mnb profile delete all       # remove every profile folder of the pool",
    ])
    p.add_argument("action", nargs="?", default="list", choices=["list", "open", "delete"], help="what to do")
    p.add_argument("target", nargs="?", default=None, metavar="FOLDER|all",
                   help="a profile folder (default: mnb.last_profile's); delete also takes 'all' (the pool's)")
    return p


def plan_parser() -> MagicArgumentParser:
    p = _parser("%mnb plan", "Enumerate the valid layouts, predict memory and step time / MFU, "
                "mark what does not fit (pure Python: no pool needed).", [
        "%mnb plan --model llama-8b --gpus 8 --gpu h200",
        "%mnb plan --model llama-70b --gpus 64 --seq 8192 --gbs 512 --top 5",
        "%mnb plan --model /models/Llama-3.2-1B --gpus 8     # a Hugging Face checkpoint folder (its config.json)",
        "%mnb plan --model llama-8b --gpus 64 --calibrate   # with this pool's measured GPU",
    ])
    p.add_argument("--model", required=True, metavar="PRESET|PATH",
                   help="model preset, e.g. llama-8b, or a Hugging Face checkpoint folder (its config.json is read)")
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs")
    p.add_argument("--gpu", default="h200", help="GPU type from the hardware table")
    p.add_argument("--seq", type=int, default=None, metavar="S",
                   help="sequence length (default: the model's)")
    p.add_argument("--mbs", type=int, default=1, metavar="M", help="micro batch size")
    p.add_argument("--gbs", type=int, default=None, metavar="G",
                   help="global batch size (default: 4 * gpus * mbs)")
    p.add_argument("--top", type=int, default=10, metavar="K", help="rows to show")
    p.add_argument("--calibrate", action="store_true",
                   help="first measure the live pool's GEMM rates by shape, memory and all-reduce bandwidth "
                        "(seconds; CPU ranks measure the CPU) and plan with them instead of --gpu's table entry")
    return p


def run_parser() -> MagicArgumentParser:
    p = _parser("%mnb run", "Run a script written for torchrun on the ranks, unmodified, as torchrun --nproc-per-node N "
                "SCRIPT ARGS would (on the warm pool: no start-up); its globals stay for later cells, like %run. "
                "init_process_group, set_device and Megatron's parallel-state calls are adopted (docs/magics.md); "
                "its get_forward_backward_func steps are measured into mnb.last_run.", [
        "%mnb run train.py --lr 3e-4 --steps 20",
        "%mnb run --timeout 600 examples/pretrain_gpt.py --tensor-model-parallel-size 2",
        "%mnb run --ranks 0 prepare_data.py      # a script that uses no process group",
        "%mnb run --isolated train.py            # in fresh rank processes (a pool restart before and after)",
    ])
    p.add_argument("--ranks", default=None, metavar="0,2-3",
                   help="run on these ranks only; a script that joins the process group needs them all "
                        "(default: every rank)")
    p.add_argument("--timeout", type=_positive_float, default=None, metavar="SECONDS",
                   help="seconds before the script is stopped (default: the pool's --cell-timeout, else none)")
    p.add_argument("--grace", type=_non_negative_float, default=None, metavar="SECONDS",
                   help="seconds the other ranks may take to finish after one rank failed (default: the pool's)")
    p.add_argument("--isolated", action="store_true",
                   help="run in fresh rank processes, for scripts whose state cannot be reset: the pool restarts "
                        "before and after the script (seconds each; the layout is kept, the ranks' names are not; "
                        "default: off, the warm ranks run it in a fresh-process sandbox)")
    p.add_argument("script", metavar="SCRIPT", help="the script's path (options for %%mnb run come before it)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments (sys.argv[1:])")
    return p


def export_parser() -> MagicArgumentParser:
    from mnb.exports import KINDS

    p = _parser("%mnb export", "Write the current layout and the last mnb.gpt/mnb.train settings as Megatron-LM "
                "pretrain_gpt.py arguments, torchrun command lines or an sbatch script for N nodes x G GPUs; "
                "refused, with the numbers, when they cannot run there (mnb/exports.py).", [
        "%mnb export                                   # Megatron-LM arguments for the notebook's world",
        "%mnb export torchrun --nodes 2 --gpus-per-node 8",
        "%mnb export slurm --nodes 4 --gpus-per-node 8 --gbs 256 -o train.sbatch --sbatch-arg=--partition=gpu",
        "%mnb export megatron-lm --model llama-8b --tp 4 --pp 2 --nodes 2 --gpus-per-node 8",
        "%mnb export slurm --fsdp --tp 2 --nodes 2 --gpus-per-node 8   # --use-megatron-fsdp (ZeRO-3)",
        "%mnb export --model /models/Qwen2.5-0.5B --gpus-per-node 8   # HuggingFaceTokenizer, --add-qkv-bias, ...",
    ])
    p.add_argument("kind", nargs="?", default="megatron-lm", choices=list(KINDS), help="what to write")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes of the target")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="GPUs per node (default: the pool's world size, on one node)")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="write to FILE instead of printing (default: print)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="slurm: a further #SBATCH option, repeatable (default: none)")
    settings = p.add_argument_group("settings (default: the notebook's last mnb.gpt/mnb.train, else mnb's defaults)")
    settings.add_argument("--model", default=None, metavar="PRESET|PATH",
                          help="model preset, e.g. llama-8b, or a Hugging Face checkpoint folder, whose tokenizer "
                               "the arguments then name (default: the last)")
    for flag, field, kind, what in (("--seq", "seq_length", int, "sequence length"),
                                    ("--steps", "steps", int, "training iterations"),
                                    ("--mbs", "micro_batch_size", int, "micro batch size"),
                                    ("--gbs", "global_batch_size", int, "global batch size"),
                                    ("--lr", "lr", float, "peak learning rate"),
                                    ("--data", "data", str, "data: mock, or a Megatron .bin/.idx prefix")):
        settings.add_argument(flag, dest=field, type=kind, default=None, metavar=field.split("_")[0].upper(),
                              help=f"{what} (default: the last)")
    layout = p.add_argument_group("layout (naming any of these sets the whole layout, as in %%megatron; "
                                  "default: the pool's, dp recomputed for the target)")
    for name in ("tp", "pp", "vpp", "cp", "ep"):
        layout.add_argument(f"--{name}", type=int, default=None, metavar="N", help=f"{name} size (default: see above)")
    layout.add_argument("--sp", dest="sp", action="store_true", default=None,
                        help="sequence parallelism on (default: see above)")
    layout.add_argument("--fsdp", nargs="?", const="optim_grads_params", default=None, choices=FSDP_STRATEGIES,
                        metavar="{" + ",".join(FSDP_STRATEGIES) + "}",
                        help="Megatron-FSDP (--use-megatron-fsdp --data-parallel-sharding-strategy STRATEGY; "
                             "--fsdp alone: optim_grads_params) (default: see above)")
    return p


SUBCOMMAND_PARSERS: dict[str, Callable[[], MagicArgumentParser]] = {
    "start": start_parser, "status": status_parser, "stop": stop_parser, "restart": restart_parser,
    "stacks": stacks_parser, "debug": debug_parser, "plot": plot_parser, "plan": plan_parser, "run": run_parser,
    "export": export_parser, "profile": profile_parser,
}


def _before_script(words: list[str]) -> list[str]:
    """The words of ``%mnb run`` that are its own: ``-h`` after SCRIPT is the script's."""
    own, valued = [], {"--ranks", "--timeout", "--grace"}
    words = iter(words)
    for word in words:
        if not word.startswith("-"):
            break
        own.append(word)
        if word in valued:
            own.append(next(words, ""))
    return own


def mnb_overview() -> str:
    """What ``%mnb --help`` prints: one usage line and purpose per command."""
    lines = ["usage: %mnb COMMAND [options]     (%mnb COMMAND --help, -h or %mnb COMMAND? for one command)", ""]
    for name in MNB_COMMANDS:
        parser = SUBCOMMAND_PARSERS[name]()
        lines.append("  " + parser.format_usage().strip().removeprefix("usage: "))
        lines.append("      " + (parser.description or "").split(". ")[0].rstrip(".") + ".")
    lines += ["", "Cell magic: %%megatron [--tp N] [--pp N] ... (%%megatron? or %%megatron --help)"]
    return "\n".join(lines)


def mnb_help() -> str:
    """What ``%mnb?`` shows: the overview, then every command's flags, defaults and examples."""
    return "\n\n".join([mnb_overview()] + [SUBCOMMAND_PARSERS[name]().format_help() for name in MNB_COMMANDS])


def wants_help(argv: list[str]) -> bool:
    """``-h``/``--help`` anywhere, or a trailing ``?`` (``%mnb start -n 2?``, ``%%megatron --tp 2 ?``)."""
    return any(word in ("-h", "--help") for word in argv) or bool(argv and argv[-1].endswith("?"))


_HELP_END = re.compile(r"^(?P<magic>\s*%mnb\s+[^?\s].*?)\s*\?{1,2}\s*$")


def help_end_transformer(lines: list[str]) -> list[str]:
    """Input transformer: ``%mnb start?`` -> ``%mnb start --help``.

    IPython reads a trailing ``?`` as "inspect the last word" (``%mnb start?``
    would look up an object named ``start``); this runs before that, so the
    command's help is printed instead.  ``%mnb?`` is left to IPython (it shows
    this magic's docstring, :func:`mnb_help`).
    """
    if not lines or lines[0].lstrip().startswith("%%"):
        return lines
    out = []
    for line in lines:
        end = "\n" if line.endswith("\n") else ""
        match = _HELP_END.match(line.rstrip("\n"))
        out.append(f"{match['magic']} --help{end}" if match else line)
    return out


def requested_layout(current: ParallelConfig, args: Any, world_size: int) -> ParallelConfig:
    """The layout a ``%%megatron`` cell runs under, dp derived from ``world_size``.

    A cell that names any layout flag gets exactly that layout: the dimensions it
    does not name are 1, vpp is plain 1F1B and sequence parallelism is off.  A
    cell that names none keeps ``current``.  So a cell means the same whatever
    ran before it: ``--pp 2`` after ``--tp 2`` is tp1 pp2.
    """
    named = {name: getattr(args, name) for name in LAYOUT_FLAGS if getattr(args, name, None) is not None}
    try:
        if not named:
            return replace(current, dp=None).resolve(world_size)
        return ParallelConfig(
            tp=named.get("tp", 1), pp=named.get("pp", 1), vpp=named.get("vpp", 1),
            cp=named.get("cp", 1), ep=named.get("ep", 1), sequence_parallel=bool(named.get("sp", False)),
            fsdp=named.get("fsdp"),
        ).resolve(world_size)
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
        if wants_help(_before_script(rest) if command == "run" else rest):
            print(parser.format_help())
            return None
        return getattr(self, f"_cmd_{command}")(parser.parse_args(rest))

    def _cmd_start(self, args: argparse.Namespace) -> None:
        existing = current_pool(required=False)
        if existing is not None and existing.running:
            raise UsageError(f"a pool is already running ({existing!r}); %mnb stop or %mnb restart first")
        try:
            pool = Pool.start(
                args.n, device=args.device, gpus=parse_gpus(args.gpus) if args.gpus else None,
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

    def _cmd_status(self, args: argparse.Namespace) -> None:
        pool = current_pool(required=False)
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
        print(f"layout: {pool.layout.describe()}  ({pool!r})")
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

    def _cmd_stop(self, args: argparse.Namespace) -> None:
        pool = current_pool(required=False)
        if pool is None:
            print("no pool is running")
            return
        pool.stop()
        set_current_pool(None)
        print(f"stopped {pool.world_size} ranks")

    def _cmd_restart(self, args: argparse.Namespace) -> None:
        pool = current_pool(required=False)
        if pool is None:
            raise UsageError("no pool to restart; use %mnb start")
        began = time.perf_counter()
        pool.restart()
        print(f"restarted: {pool.world_size} ranks ready in {time.perf_counter() - began:.1f} s ({pool.start_note}); "
              f"layout {pool.layout.describe()}")

    def _cmd_stacks(self, args: argparse.Namespace) -> None:
        print(current_pool().stacks_report())

    def _cmd_debug(self, args: argparse.Namespace) -> None:
        pool = current_pool()
        if args.rank is not None and not 0 <= args.rank < pool.world_size:
            raise UsageError(f"%mnb debug {args.rank}: no such rank in world size {pool.world_size}")
        with pool_request("post-mortem"):
            pool.debug(args.rank)

    def _cmd_profile(self, args: argparse.Namespace) -> None:
        run_profile_command(args, current_pool(required=False))

    def _cmd_plot(self, args: argparse.Namespace) -> None:
        run = last_run()
        if run is None:
            raise UsageError("no run yet: train in a %%megatron cell with mnb.train(...) first")
        # Inside a kernel the figure is a pyplot one and shows itself inline.
        getattr(run, f"plot_{args.kind}")()

    def _cmd_run(self, args: argparse.Namespace) -> None:
        pool = current_pool(required=False)
        if pool is None:
            raise UsageError("no pool is running; start one with %mnb start")
        ranks = parse_ranks(args.ranks) if args.ranks else None
        if ranks is not None and max(ranks) >= pool.world_size:
            raise UsageError(f"--ranks {args.ranks}: rank {max(ranks)} does not exist in world size {pool.world_size}")
        if not os.path.isfile(os.path.expanduser(args.script)):
            raise UsageError(f"no script {args.script!r} (relative paths start in {os.getcwd()}); "
                             "%mnb run's own options come before the script, its arguments after it")
        if args.isolated:
            self._run_isolated(pool, args, ranks)
        else:
            with pool_request("script"):
                pool.run_script(args.script, args.args, ranks=ranks, timeout=args.timeout, grace=args.grace,
                                kernel=_kernel(pool, cwd=True))
        if pool.last_cell_records:
            print(last_run().summary())

    def _run_isolated(self, pool: Pool, args: argparse.Namespace, ranks: list[int] | None) -> None:
        """``%mnb run --isolated``: a restart of the pool before and after the script, layout kept."""
        layout = pool.layout
        records: list = []

        def fresh() -> float:
            t0 = time.perf_counter()
            pool.restart()
            if pool.layout != layout:
                pool.run("None", layout=layout, quiet=True)
            pool.last_cell_records = records
            return time.perf_counter() - t0

        before = fresh()
        print(f"mnb: --isolated: fresh rank processes for the script ({pool.world_size} ranks restarted in "
              f"{before:.1f} s; they restart again after it, layout {layout.describe()} kept, names of earlier "
              "cells gone; a plain %mnb run needs no restart)")
        try:
            with pool_request("script"):
                pool.run_script(args.script, args.args, ranks=ranks, timeout=args.timeout, grace=args.grace,
                                kernel=_kernel(pool, cwd=True))
            records = pool.last_cell_records
        finally:
            after = fresh()
            print(f"mnb: --isolated: the pool restarted after the script in {after:.1f} s")

    def _cmd_export(self, args: argparse.Namespace) -> None:
        from mnb.exports import export

        settings = {k: getattr(args, k) for k in ("seq_length", "steps", "micro_batch_size", "global_batch_size",
                                                  "lr", "data") if getattr(args, k) is not None}
        named = {name: getattr(args, name) for name in LAYOUT_FLAGS if getattr(args, name, None) is not None}
        try:
            layout = None
            if named:
                layout = ParallelConfig(tp=named.get("tp", 1), pp=named.get("pp", 1),
                                        vpp=named.get("vpp", 1), cp=named.get("cp", 1),
                                        ep=named.get("ep", 1), sequence_parallel=bool(named.get("sp")),
                                        fsdp=named.get("fsdp"))
            exported = export(args.kind, nodes=args.nodes, gpus_per_node=args.gpus_per_node, model=args.model,
                              layout=layout, output=args.output, sbatch_options=args.sbatch_arg, **settings)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if args.output:
            then = {"slurm": f"; submit it with: sbatch {args.output}", "torchrun": f"; run it: bash {args.output}"}
            print(f"wrote {args.output}: {args.kind} for {exported.model.name}, {exported.layout.describe()} on "
                  f"{exported.nodes} node(s) x {exported.gpus_per_node} GPU(s)" + then.get(args.kind, ""))
        else:
            print(exported.text, end="")

    def _cmd_plan(self, args: argparse.Namespace) -> None:
        from mnb.estimate import plan
        from mnb.plot import plot_plan

        gpu = self._calibrated_gpu() if args.calibrate else args.gpu
        try:
            rows = plan(args.model, args.gpus, gpu=gpu, seq=args.seq, mbs=args.mbs, gbs=args.gbs)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        from mnb.estimate import format_plan

        print(format_plan(rows[: args.top]))
        plot_plan(rows)

    def _calibrated_gpu(self) -> str:
        """Measure the live pool (mnb.megatron.calibrate), register it as a device, return its name."""
        from mnb.estimate.measured import describe, register_measurement

        pool = current_pool(required=False)
        if pool is None:
            raise UsageError("--calibrate measures the live pool's devices: start one first "
                             "(%mnb start -n 2 --device cuda) or drop --calibrate to plan with --gpu's table entry")
        values = pool.run("__import__('mnb.megatron.calibrate', fromlist=['measure']).measure()", quiet=True)
        try:
            dev = register_measurement(values[min(values)])
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        print(describe(dev))
        return dev.name

    @cell_magic
    def megatron(self, line: str, cell: str) -> None:
        """Run the cell on the ranks under a Megatron layout (replaced by megatron_parser().format_help())."""
        parser = megatron_parser()
        argv = shlex.split(line, comments=True)
        if wants_help(argv):
            print(parser.format_help())
            return
        args = parser.parse_args(argv)
        pool = current_pool(required=False)
        if pool is None:
            raise UsageError("no pool is running; start one with %mnb start")
        layout = requested_layout(pool.layout, args, pool.world_size)
        if layout.fsdp == "optim" and pool.spec.device == "cpu":
            raise UsageError(FSDP_OPTIM_ON_CPU)
        ranks = parse_ranks(args.ranks) if args.ranks else None
        if ranks is not None and max(ranks) >= pool.world_size:
            raise UsageError(f"--ranks {args.ranks}: rank {max(ranks)} does not exist in world size {pool.world_size}")
        problems = check_cell(cell, layout)
        if problems:
            raise UsageError("refused before running on the ranks:\n  " + "\n  ".join(problems))
        profile = profile_request(args, pool, parse_ranks)
        debug_ranks = parse_ranks(args.debug_ranks) if args.debug_ranks else None
        if debug_ranks is not None and max(debug_ranks) >= pool.world_size:
            raise UsageError(f"--debug-ranks {args.debug_ranks}: rank {max(debug_ranks)} does not exist in world "
                             f"size {pool.world_size}")
        since = time.time() - 1
        try:
            with pool_request("cell"):
                pool.run(cell, ranks=ranks, timeout=args.timeout, layout=layout, show_result=True, grace=args.grace,
                         kernel=_kernel(pool, cwd=False), profile=profile, debug_ranks=debug_ranks)
        finally:
            shown = take_profile(profile["dir"] if profile else None, pool, since)
        remember_settings(**cell_settings(cell))  # what %mnb export takes as "the last settings"
        if pool.last_cell_records:
            print(last_run().summary())
        if shown is not None:
            print(shown.summary())


def slurm_request(args: argparse.Namespace) -> Any:
    """The SlurmRequest of ``%mnb start --slurm ...``, None without --slurm; UsageError for a stray Slurm flag."""
    given = [f"--{n.replace('_', '-')}" for n in ("nodes", "gpus_per_node", "partition", "time", "account")
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


@contextlib.contextmanager
def pool_request(what: str) -> Iterator[None]:
    """How ``%%megatron`` and ``%mnb run`` show a request's end: a refusal as a usage error,
    an interrupt as one line (the pool's own account when it gave one)."""
    try:
        yield
    except RequestRefused as exc:
        raise UsageError(str(exc)) from None
    except KeyboardInterrupt as exc:
        if hasattr(exc, "_render_traceback_"):  # the pool's one-line account of the interrupt
            raise
        raise interrupted(f"interrupted in the notebook kernel after the ranks had finished the {what}") from None


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
