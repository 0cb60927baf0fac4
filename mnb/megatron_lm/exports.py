"""From notebook to cluster: the notebook's layout and settings as a Megatron-LM launch.

The notebook is where a layout is found; a cluster is where it trains.  This
module writes what a cluster job needs, from the same dataclasses the ranks
used (:mod:`mnb.config`), so nothing is retyped by hand::

    %mnb export megatron-lm --nodes 2 --gpus-per-node 8      # pretrain_gpt.py arguments
    %mnb export torchrun --nodes 2 --gpus-per-node 8         # the torchrun command line(s)
    %mnb export slurm --nodes 2 --gpus-per-node 8 -o train.sbatch

    mnb.export("megatron-lm", model="llama-1b", micro_batch_size=1, global_batch_size=64)

Where the settings come from, each one separately: what the call names, else the last
training (``mnb.last_run``) or the last ``mnb.gpt(...)``/``mnb.train(...)`` with
literal arguments a ``%%megatron`` cell ran, else the dataclass defaults; the layout
is the pool's current one (its ``dp`` is recomputed for the target's world size).
A request that cannot run on the target is refused before anything is written,
with the numbers (``global_batch_size(16) is not divisible by ...``).

Megatron-LM's names are its own (``megatron/training/arguments.py``); a test parses
the output with Megatron's own parser where ``megatron.training`` is installed
(megatron-core 0.19 on Python 3.12) and compares the values with the notebook's.
Pure Python: the notebook kernel never imports torch.  The module is ``mnb.megatron_lm.exports``
(old path ``mnb.exports``); neither is named ``mnb.export``: importing a submodule binds its name on
the package, which would hide the function ``mnb.export``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from mnb import writes
from mnb.config import ModelConfig, ParallelConfig, TrainConfig, batch_problem, interleave_problem
from mnb.megatron_lm.export_args import megatron_lm_args
from mnb.launch_templates import render_template
from mnb.model_source import resolve_model, tokenizer_folder

KINDS = ("megatron-lm", "torchrun", "slurm")
"""What ``%mnb export`` writes: Megatron-LM's arguments, torchrun command lines, an sbatch script."""

RDZV_PORT = 29500
"""torchrun's c10d rendezvous port on the first node (the scripts let RDZV_PORT override it)."""

_TRAIN_FIELDS = {f.name for f in fields(TrainConfig)}
_MODEL_FIELDS = {f.name for f in fields(ModelConfig)} - {"name", "extra"}


@dataclass(frozen=True)
class Exported:
    """What :func:`export` wrote: ``text`` (print it or :meth:`save` it) and the pieces behind it."""

    kind: str
    text: str
    args: tuple[str, ...]
    """Megatron-LM's ``pretrain_gpt.py`` argument list (the same in every kind)."""
    notes: tuple[str, ...]
    """What the argument list cannot say (TE, data), also written as comment lines."""
    model: ModelConfig
    train: TrainConfig
    layout: ParallelConfig
    """Resolved for the target: ``dp = nodes * gpus_per_node / (tp * pp * cp)``."""
    nodes: int
    gpus_per_node: int
    tokenizer: str | None = None
    """The Hugging Face checkpoint folder whose tokenizer the arguments name, or None (NullTokenizer)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write ``text`` to ``path`` (an sbatch or shell script is made executable).

        An existing file that is not an mnb export is refused (:func:`check_output`) unless ``overwrite``."""
        path = Path(path).expanduser()
        check_output(path, overwrite=overwrite)
        path.write_text(self.text, encoding="utf-8")
        if self.kind != "megatron-lm":
            path.chmod(0o755)
        return path

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return (f"<mnb.Exported {self.kind}: {self.model.name}, {self.layout.describe()} on "
                f"{self.nodes} x {self.gpus_per_node} GPUs; print() it or .save(path)>")


def export(kind: str = "megatron-lm", *, nodes: int = 1, gpus_per_node: int | None = None,
           model: str | ModelConfig | dict | None = None, train: TrainConfig | dict | None = None,
           layout: ParallelConfig | None = None, output: str | Path | None = None,
           job_name: str | None = None, sbatch_options: list[str] | None = None,
           overwrite: bool = False, **settings: Any) -> Exported:
    """Megatron-LM arguments, torchrun command lines or an sbatch script for ``nodes`` x ``gpus_per_node``.

    ``settings`` are TrainConfig fields (``global_batch_size=64``, ``lr=1e-4``) or ModelConfig
    fields (``seq_length=4096``) that replace the notebook's.  ``gpus_per_node`` defaults to the
    notebook's world size on one node.  ``sbatch_options`` (slurm: e.g. ``["--partition=gpu",
    "--time=4:00:00"]``) become ``#SBATCH`` lines.  ``output`` also writes the text there: a new
    file, or an earlier mnb export; any other existing file is refused before anything else
    (:class:`~mnb.errors.OverwriteRefusedError`) unless ``overwrite=True``.
    Raises ValueError, saying what to change, when the request cannot run on the target.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown export {kind!r}; choose from {', '.join(KINDS)}")
    if output is not None:
        check_output(Path(output).expanduser(), overwrite=overwrite)
    remembered = _notebook_settings()
    model_cfg, train_cfg, tokenizer = _model_and_train(model, train, settings, remembered)
    if not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
    if gpus_per_node is None:
        if nodes > 1 or not remembered.get("world_size"):
            raise ValueError("say how many GPUs each node has: --gpus-per-node G (gpus_per_node=G)")
        gpus_per_node = remembered["world_size"]
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
    base = layout or (ParallelConfig(**remembered["layout"]) if remembered.get("layout") else ParallelConfig())
    resolved = check_target(model_cfg, train_cfg, base, nodes, gpus_per_node)
    args, notes = megatron_lm_args(model_cfg, train_cfg, resolved, tokenizer=tokenizer,
                                   data_prefix=_data_prefix(train_cfg, remembered))
    header = _header(model_cfg, resolved, nodes, gpus_per_node)
    if kind == "megatron-lm":
        text = "\n".join([header, *(f"# {n}" for n in notes), format_args(args, continuation=True)]) + "\n"
    elif kind == "torchrun":
        text = _torchrun_text(header, notes, args, nodes, gpus_per_node, model_cfg.name, connections_line(resolved))
    else:
        text = render_template("megatron-lm.sbatch", {
            "header": "\n".join([header, *(f"# {n}" for n in notes)]),
            "job_name": job_name or f"megatron-{model_cfg.name}",
            "nodes": nodes, "gpus_per_node": gpus_per_node,
            "sbatch_options": "\n".join(f"#SBATCH {o}" for o in (sbatch_options or [])),
            "args": format_args(args, indent="  "),
            "rdzv_port": RDZV_PORT, "cuda_connections": connections_line(resolved),
        })
    exported = Exported(kind=kind, text=text, args=tuple(args), notes=tuple(notes), model=model_cfg,
                        train=train_cfg, layout=resolved, nodes=nodes, gpus_per_node=gpus_per_node,
                        tokenizer=tokenizer)
    if output is not None:
        exported.save(output, overwrite=overwrite)
    return exported


EXPORT_MARK = "exported by mnb"
"""In the first lines of every export (:func:`_header`): how an earlier export is recognised."""


def is_export(path: Path) -> bool:
    """Whether the file ``path`` is an earlier mnb export: :data:`EXPORT_MARK` in one of its first three lines."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            head = [handle.readline() for _ in range(3)]
    except OSError:
        return False
    return any(line.startswith("#") and EXPORT_MARK in line for line in head)


def check_output(path: Path, *, overwrite: bool, writer: str = "mnb.export", flag: str = "overwrite=True") -> None:
    """Refuse (:class:`~mnb.errors.OverwriteRefusedError`) an existing ``path`` that is not an mnb export,
    unless ``overwrite``; ``writer`` and ``flag`` name the call and its flag in the message."""
    writes.check_file(path, is_export, overwrite=overwrite, writer=writer, flag=flag,
                      what=f"an mnb export (no '# ... {EXPORT_MARK}' line at its top)")


# ------------------------------------------------------------------ settings
def _notebook_settings() -> dict[str, Any]:
    """The notebook's last model/train settings, its current layout and world size (all optional)."""
    from mnb.controller.registry import current_pool, last_settings

    found = dict(last_settings())
    pool = current_pool(required=False)
    if pool is not None:
        found["layout"] = pool.layout.as_dict()
        found["world_size"] = pool.world_size
    return found


def _model_and_train(model: Any, train: Any, settings: dict[str, Any],
                     remembered: dict[str, Any]) -> tuple[ModelConfig, TrainConfig, str | None]:
    """The model, the training settings, and the checkpoint folder of the model's tokenizer (or None)."""
    unknown = sorted(set(settings) - _TRAIN_FIELDS - _MODEL_FIELDS)
    if unknown:
        raise TypeError(f"export() got unknown settings {unknown}; use TrainConfig fields "
                        f"({', '.join(sorted(_TRAIN_FIELDS))}) or ModelConfig fields (e.g. seq_length)")
    if model is None:
        if not remembered.get("model"):
            raise ValueError("no model to export: name one (--model PRESET|PATH, model='llama-1b'), or run "
                             "mnb.gpt(...) / mnb.from_hf(...) / mnb.train(...) in a %%megatron cell first")
        model = ModelConfig.from_dict(remembered["model"])
        tokenizer = remembered.get("tokenizer")
    else:
        tokenizer = tokenizer_folder(model)
    model_cfg = resolve_model(model)
    # fp8 names two settings: a recipe string is the model's FP8 linears (ModelConfig.fp8), True/False TE's
    # (TrainConfig.fp8)
    settings = dict(settings)
    if isinstance(settings.get("fp8"), bool):
        train_fp8 = {"fp8": settings.pop("fp8")}
    else:
        train_fp8 = {}
    model_overrides = {k: v for k, v in settings.items() if k in _MODEL_FIELDS}
    if model_overrides:
        model_cfg = model_cfg.with_overrides(**model_overrides)
    if train is None:
        train = remembered.get("train") or {}
    train_fields = train.to_dict() if isinstance(train, TrainConfig) else dict(train)
    train_fields.update({k: v for k, v in settings.items() if k in _TRAIN_FIELDS - _MODEL_FIELDS}, **train_fp8)
    if "steps" in settings and "schedule_steps" not in settings:
        train_fields["schedule_steps"] = None  # steps named here: the exported run is that long
    return model_cfg, TrainConfig(**{k: v for k, v in train_fields.items() if k in _TRAIN_FIELDS}), tokenizer


def _data_prefix(train: TrainConfig, remembered: dict[str, Any]) -> str | None:
    """The ``.bin/.idx`` prefix the notebook's ranks read ``train.data`` from, when the last training
    read that same ``data`` (the ranks report it: ``data_prefix`` in the run record), else None."""
    prefix = remembered.get("data_prefix")
    if prefix and (remembered.get("train") or {}).get("data") == train.data:
        return prefix
    return None


def check_target(model: ModelConfig, train: TrainConfig, layout: ParallelConfig, nodes: int,
                 gpus_per_node: int) -> ParallelConfig:
    """The layout resolved for ``nodes * gpus_per_node`` ranks, or ValueError with the numbers."""
    world = nodes * gpus_per_node
    where = f"on {nodes} node(s) x {gpus_per_node} GPU(s) = world size {world}"
    try:
        resolved = replace(layout, dp=None).resolve(world)
        model.check_parallel(resolved)
    except ValueError as exc:
        raise ValueError(f"{exc} ({where})") from None
    per_microbatch = train.micro_batch_size * resolved.dp
    gbs = train.global_batch_size or per_microbatch
    problem = batch_problem(gbs, train.micro_batch_size, resolved.dp) or \
        interleave_problem(gbs // per_microbatch, resolved.pp, resolved.vpp, per_microbatch)
    if problem:
        head, _, advice = problem.partition("; ")
        raise ValueError(f"{head} {where} with {resolved.describe()}; {advice}")
    if resolved.ep > 1 and resolved.tp > 1 and not resolved.sequence_parallel:
        raise ValueError(f"Megatron-LM needs sequence parallelism with ep({resolved.ep}) and tp({resolved.tp}) "
                         "> 1: add --sp (sequence_parallel=True) to the layout")
    train.check_schedule()
    return resolved


# ------------------------------------------------------------------ rendering
def connections_line(layout: ParallelConfig) -> str:
    """The launch scripts' CUDA_DEVICE_MAX_CONNECTIONS line: 1 for Megatron's TP overlap, unset under FSDP.

    Megatron-LM asserts ``== "1"`` with tp or cp > 1 (before Blackwell) and ``!= "1"`` under
    ``--use-megatron-fsdp`` (where tp/cp only warn): one line cannot serve both.
    """
    if layout.fsdp is not None:
        return "unset CUDA_DEVICE_MAX_CONNECTIONS   # Megatron-LM asserts it is not 1 under --use-megatron-fsdp"
    return "export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron-LM's own scripts set this: TP communication overlaps compute"


def format_args(args: list[str] | tuple[str, ...], *, continuation: bool = False, indent: str = "") -> str:
    """One flag (and its value) per line, shell-quoted; ``continuation`` ends lines with `` \\``."""
    lines: list[list[str]] = []
    for word in args:
        if word.startswith("--") or not lines:
            lines.append([word])
        else:
            lines[-1].append(word)
    rendered = [indent + " ".join(shlex.quote(w) for w in line) for line in lines]
    if continuation:
        rendered = [line + " \\" for line in rendered[:-1]] + rendered[-1:]
    return "\n".join(rendered)


def _header(model: ModelConfig, layout: ParallelConfig, nodes: int, gpus_per_node: int) -> str:
    from mnb.version import __version__

    return (f"# Megatron-LM pretrain_gpt.py, {EXPORT_MARK} {__version__}: {model.name} "
            f"({_count(model.num_parameters())} parameters), {layout.describe()} on "
            f"{nodes} node(s) x {gpus_per_node} GPU(s)")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n / 1e3:.0f} K"


def _torchrun_text(header: str, notes: list[str], args: list[str], nodes: int, gpus_per_node: int,
                   name: str, connections: str) -> str:
    launch = [f"torchrun --standalone --nproc-per-node={gpus_per_node}"] if nodes == 1 else [
        f"torchrun --nnodes={nodes} --nproc-per-node={gpus_per_node} --rdzv-id=mnb-{name} --rdzv-backend=c10d "
        f'--rdzv-endpoint="$HEAD_NODE:${{RDZV_PORT:-{RDZV_PORT}}}"'
    ]
    where = (f"# on the one node ({gpus_per_node} GPUs):" if nodes == 1 else
             f"# on each of the {nodes} nodes ({gpus_per_node} GPUs each), HEAD_NODE being the first "
             "node's hostname (the same on all):")
    return "\n".join([
        header, *(f"# {n}" for n in notes),
        "MEGATRON_LM=${MEGATRON_LM:-$HOME/Megatron-LM}   # a Megatron-LM checkout (pretrain_gpt.py)",
        "# bash THIS_FILE [MORE PRETRAIN_GPT.PY ARGUMENTS]: they follow ARGS, so they add to it or override it",
        connections, "ARGS=(", format_args(args, indent="  "), ")", where,
        f'{launch[0]} "$MEGATRON_LM/pretrain_gpt.py" "${{ARGS[@]}}" "$@"   # the script\'s own arguments come last',
    ]) + "\n"
