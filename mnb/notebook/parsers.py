"""The flags of ``%mnb COMMAND`` and ``%%megatron``: one argparse parser per command.

Kept out of :mod:`mnb.notebook.magics` (which dispatches) so the flags, their defaults and their help
text live in one place that the help (:mod:`mnb.notebook.help`), the docs test and the command
modules all read; nothing here touches a pool.  Torch-free.
"""

from __future__ import annotations

import argparse
from typing import Callable

from IPython.core.error import UsageError
from IPython.core.magic_arguments import MagicArgumentParser, MagicHelpFormatter

from mnb.config import FSDP_STRATEGIES, ParallelConfig
from mnb.fields import check_ranks, check_seconds, seconds_rule
from mnb.timeouts import DEFAULT_GRACE_S, START_TIMEOUT_S


def parse_ranks(text: str | None, world_size: int, flag: str = "--ranks") -> list[int] | None:
    """'0,2-3' -> [0, 2, 3], each a rank of ``world_size``; None when ``text`` is empty (every rank).

    The one reading of a rank list (``--ranks``, ``--debug-ranks``, ``--profile-ranks``); the range rule
    is :func:`mnb.fields.check_ranks`'s, the pool's own.  UsageError names ``flag`` and says what is wrong."""
    if not text:
        return None
    ranks: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                low, high = (int(x) for x in part.split("-", 1))
                if low > high:
                    raise UsageError(f"{flag} {text}: bad rank range {part!r}: {low} > {high}")
                ranks.update(range(low, high + 1))
            else:
                ranks.add(int(part))
        except ValueError:
            raise UsageError(f"{flag} {text}: bad rank list: use numbers and ranges, e.g. 0,2-3") from None
    if not ranks or min(ranks) < 0:
        raise UsageError(f"{flag} {text}: bad rank list: use non-negative numbers and ranges, e.g. 0,2-3")
    try:
        return check_ranks(ranks, world_size)
    except ValueError as exc:
        raise UsageError(f"{flag} {text}: {exc}") from None


def parse_gpus(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"bad --gpus {text!r}: use GPU ids such as 0,1") from None


def _number(kind: type, text: str, rule: str, ok: Callable[[float], bool]) -> float:
    """``text`` as ``kind`` when ``ok`` accepts it; else ArgumentTypeError with the rule and the value
    (argparse puts the flag in front: ``argument --timeout: must be a positive number, got '0'``)."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
    return value


def _seconds(text: str, *, zero_ok: bool) -> float:
    """``text`` as seconds under :func:`mnb.fields.check_seconds`' rule, the one ``pool.run(timeout=, grace=)``
    is checked by (ArgumentTypeError with the rule and the text)."""
    rule = seconds_rule(zero_ok=zero_ok)
    try:
        return check_seconds(float(text), "seconds", zero_ok=zero_ok)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}") from None


def _timeout_seconds(text: str) -> float:
    return _seconds(text, zero_ok=False)


def _grace_seconds(text: str) -> float:
    return _seconds(text, zero_ok=True)


def _positive_float(text: str) -> float:
    return _number(float, text, "a positive number", lambda v: v > 0)


def _positive_int(text: str) -> int:
    return int(_number(int, text, "a positive integer", lambda v: v > 0))


LAYOUT_FLAGS = ("tp", "pp", "vpp", "cp", "ep", "sp", "fsdp")
"""The %%megatron flags that name a layout: a cell naming any of them runs under exactly that layout."""


def layout_from_flags(args: argparse.Namespace) -> ParallelConfig | None:
    """The layout the parsed flags name (:func:`layout_arguments`), None when they name none.

    Naming any layout flag sets the whole layout: the dimensions not named are 1, sequence
    parallelism and FSDP off.  dp is left to ``resolve``; ValueError (from ParallelConfig) says what
    is wrong.  ``%%megatron`` and ``%mnb export`` both read their flags through this."""
    named = {name: getattr(args, name) for name in LAYOUT_FLAGS if getattr(args, name, None) is not None}
    if not named:
        return None
    return ParallelConfig(tp=named.get("tp", 1), pp=named.get("pp", 1), vpp=named.get("vpp", 1),
                          cp=named.get("cp", 1), ep=named.get("ep", 1),
                          sequence_parallel=bool(named.get("sp", False)), fsdp=named.get("fsdp"))


def layout_arguments(p: MagicArgumentParser, title: str, sizes: dict[str, str], default: Callable[[str], str],
                     fsdp: str) -> None:
    """The layout flags (:data:`LAYOUT_FLAGS`) as one argument group, read by :func:`layout_from_flags`.

    ``sizes``: what each of --tp --pp --vpp --cp --ep is; ``default(name)``: the text after
    ``default:`` in its help (and --sp's, --fsdp's); ``fsdp``: --fsdp's help before its default."""
    g = p.add_argument_group(title)
    for name, what in sizes.items():
        g.add_argument(f"--{name}", type=int, default=None, metavar="N", help=f"{what} (default: {default(name)})")
    g.add_argument("--sp", dest="sp", action="store_true", default=None,
                   help=f"sequence parallelism on (default: {default('sp')})")
    g.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallelism off (default: see --sp)")
    g.add_argument("--fsdp", nargs="?", const="optim_grads_params", default=None, choices=FSDP_STRATEGIES,
                   metavar="{" + ",".join(FSDP_STRATEGIES) + "}", help=f"{fsdp} (default: {default('fsdp')})")
    g.add_argument("--dp", action=_DerivedDp, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


class _DerivedDp(argparse.Action):
    """``--dp``, which users try (Megatron-LM has no such flag either): an error that says how dp is set."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.pop("nargs", None)
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--dp is not a flag: data parallelism is what the other sizes leave, dp = ranks / (tp * pp * "
                     "cp), as in Megatron; set those (with --tp 1 --pp 1 --cp 1 every rank is a data-parallel "
                     "replica)")

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
        "%mnb start --slurm --nodes 2 --ntasks-per-node 1 --device cpu --ip 0.0.0.0",
    ])
    p.add_argument("-n", type=_positive_int, default=None, metavar="N",
                   help="ranks on this host (default: one per visible GPU, else 2 CPU ranks)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when a GPU is visible, else cpu with gloo")
    p.add_argument("--gpus", default=None, metavar="0,1,..",
                   help="GPU ids, sets CUDA_VISIBLE_DEVICES (default: every visible GPU)")
    p.add_argument("--timeout", type=_timeout_seconds, default=START_TIMEOUT_S, metavar="SECONDS",
                   help="seconds to wait for the ranks to be ready")
    p.add_argument("--cell-timeout", type=_timeout_seconds, default=None, metavar="SECONDS",
                   help="default timeout of every cell (default: none)")
    p.add_argument("--grace", type=_grace_seconds, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="seconds the other ranks may take to finish a cell after one rank failed")
    p.add_argument("--nnodes", type=_positive_int, default=1, metavar="K",
                   help="torchrun nodes; the others join with the printed command")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="torchrun rendezvous for several nodes (default: this host:29400 when --nnodes > 1)")
    p.add_argument("--ip", default="127.0.0.1",
                   help="interface the controller binds; 0.0.0.0 lets ranks on other hosts connect")
    p.add_argument("--threads", type=_positive_int, default=None, metavar="T",
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
    g.add_argument("--nodes", type=_positive_int, default=None, metavar="N",
                   help="nodes of the job (default: 1 with --slurm)")
    g.add_argument("--gpus-per-node", type=_positive_int, default=None, metavar="G",
                   help="GPUs, and ranks, per node (default: none: CPU ranks, -n per node)")
    g.add_argument("--ntasks-per-node", type=_positive_int, default=None, metavar="N",
                   help="ranks per node, Slurm's name for -n under --slurm (default: --gpus-per-node, "
                        "else -n, else 2 CPU ranks)")
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
                   "without restarting the Jupyter kernel; names defined in cells are gone, the layout stays "
                   "(as after an automatic restart). A cell naming layout flags changes it (%%megatron --tp 1: "
                   "the default); from Python: mnb.pool().restart(layout=mnb.ParallelConfig()).",
                   ["%mnb restart"])


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
    def default(name: str) -> str:
        when = f"{getattr(defaults, name) or 1}" if name in ("tp", "pp", "vpp", "cp", "ep") else "off"
        return f"{when} when the cell names another layout flag; the pool's when it names none"

    layout_arguments(
        p, "layout (naming any of these sets the whole layout)",
        {"tp": "tensor-parallel size", "pp": "pipeline-parallel size",
         "vpp": "virtual pipeline stages per rank (interleaved 1F1B; needs --pp 2 or more)",
         "cp": "context-parallel size (long sequences; TE attention when installed, else mnb's)",
         "ep": "expert-parallel size (MoE models)"},
        default,
        fsdp="Megatron-FSDP over the dp ranks: shard the optimizer state (optim, ZeRO-1), and the gradients "
             "(optim_grads, ZeRO-2), and the parameters (optim_grads_params, ZeRO-3; --fsdp alone); not with --pp, "
             "optim not on CPU ranks",
    )
    run = p.add_argument_group("running")
    run.add_argument("--ranks", default=None, metavar="0,2-3", help="run on these ranks only (default: every rank)")
    run.add_argument("--timeout", type=_timeout_seconds, default=None, metavar="SECONDS",
                     help="seconds before the cell is stopped (default: the pool's --cell-timeout, else none)")
    run.add_argument("--grace", type=_grace_seconds, default=None, metavar="SECONDS",
                     help="seconds the other ranks may take to finish after one rank failed "
                          f"(default: the pool's --grace, {DEFAULT_GRACE_S:g} s unless %%mnb start set it)")
    run.add_argument("--debug-ranks", default=None, metavar="0,2-3",
                     help="only these ranks stop at breakpoint() and pdb.set_trace(); the others skip them "
                          "(default: every rank, served one after another in rank order)")
    profile_arguments(p)
    return p


def profile_arguments(p: MagicArgumentParser) -> None:
    """``%%megatron``'s profiling flags (mnb.megatron.profile, mnb.notebook.profiles)."""
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


def _fp8_choices() -> tuple:
    from mnb.config import ModelConfig
    from mnb.fields import choices

    return choices(ModelConfig, "fp8")


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
    p.add_argument("--gpus", type=_positive_int, required=True, metavar="N", help="number of GPUs")
    p.add_argument("--gpu", default="h200", help="GPU type from the hardware table")
    p.add_argument("--seq", type=_positive_int, default=None, metavar="S",
                   help="sequence length (default: the model's)")
    p.add_argument("--mbs", type=_positive_int, default=1, metavar="M", help="micro batch size")
    p.add_argument("--gbs", type=_positive_int, default=None, metavar="G",
                   help="global batch size (default: 4 * gpus * mbs)")
    p.add_argument("--fp8", default=None, choices=_fp8_choices(),
                   help="the model's linears in FP8 (mnb.gpt(..., fp8=...)): their GEMMs at the GPU's FP8 peak "
                        "(default: bf16)")
    p.add_argument("--top", type=_positive_int, default=10, metavar="K", help="rows to show")
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
    p.add_argument("--timeout", type=_timeout_seconds, default=None, metavar="SECONDS",
                   help="seconds before the script is stopped (default: the pool's --cell-timeout, else none)")
    p.add_argument("--grace", type=_grace_seconds, default=None, metavar="SECONDS",
                   help="seconds the other ranks may take to finish after one rank failed (default: the pool's)")
    p.add_argument("--isolated", action="store_true",
                   help="run in fresh rank processes, for scripts whose state cannot be reset: the pool restarts "
                        "before and after the script (seconds each; the layout is kept, the ranks' names are not; "
                        "default: off, the warm ranks run it in a fresh-process sandbox)")
    p.add_argument("script", metavar="SCRIPT", help="the script's path (options for %%mnb run come before it)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments (sys.argv[1:])")
    return p


def export_parser() -> MagicArgumentParser:
    from mnb.megatron_lm.exports import KINDS

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
    p.add_argument("--nodes", type=_positive_int, default=1, metavar="N", help="nodes of the target")
    p.add_argument("--gpus-per-node", type=_positive_int, default=None, metavar="G",
                   help="GPUs per node (default: the pool's world size, on one node)")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="write to FILE instead of printing (default: print)")
    p.add_argument("--overwrite", action="store_true",
                   help="with -o: replace FILE although it is not an earlier mnb export (default: refuse)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="slurm: a further #SBATCH option, repeatable (default: none)")
    settings = p.add_argument_group("settings (default: the notebook's last mnb.gpt/mnb.train, else mnb's defaults)")
    settings.add_argument("--model", default=None, metavar="PRESET|PATH",
                          help="model preset, e.g. llama-8b, or a Hugging Face checkpoint folder, whose tokenizer "
                               "the arguments then name (default: the last)")
    for flag, field, kind, what in (("--seq", "seq_length", _positive_int, "sequence length"),
                                    ("--steps", "steps", _positive_int, "training iterations"),
                                    ("--mbs", "micro_batch_size", _positive_int, "micro batch size"),
                                    ("--gbs", "global_batch_size", _positive_int, "global batch size"),
                                    ("--lr", "lr", _positive_float, "peak learning rate"),
                                    ("--data", "data", str, "data: mock, or a Megatron .bin/.idx prefix"),
                                    ("--fp8", "fp8", str, "FP8 linears, tensorwise, rowwise or delayed (TE's --fp8-recipe)")):
        settings.add_argument(flag, dest=field, type=kind, default=None, metavar=field.split("_")[0].upper(),
                              help=f"{what} (default: the last)")
    layout_arguments(
        p, "layout (naming any of these sets the whole layout, as in %%megatron; "
           "default: the pool's, dp recomputed for the target)",
        {name: f"{name} size" for name in ("tp", "pp", "vpp", "cp", "ep")}, lambda name: "see above",
        fsdp="Megatron-FSDP (--use-megatron-fsdp --data-parallel-sharding-strategy STRATEGY; "
             "--fsdp alone: optim_grads_params)",
    )
    return p


SUBCOMMAND_PARSERS: dict[str, Callable[[], MagicArgumentParser]] = {
    "start": start_parser, "status": status_parser, "stop": stop_parser, "restart": restart_parser,
    "stacks": stacks_parser, "debug": debug_parser, "plot": plot_parser, "plan": plan_parser, "run": run_parser,
    "export": export_parser, "profile": profile_parser,
}
