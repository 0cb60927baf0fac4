"""``%mnb plan`` and ``%mnb export``: which layouts fit, and the launch to run one elsewhere.

Kept out of :mod:`mnb.notebook.magics` (parsing and dispatch only there).  Both work without a pool
(pure Python: ``mnb.estimate``, ``mnb.megatron_lm``); only ``%mnb plan --calibrate`` measures the
live one.  Torch-free.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from IPython.core.error import UsageError

from mnb.controller import Pool
from mnb.errors import OverwriteRefusedError
from mnb.notebook.parsers import layout_from_flags


def export_command(args: argparse.Namespace) -> None:
    from mnb.megatron_lm.exports import check_output, export

    settings = {k: getattr(args, k) for k in ("seq_length", "steps", "micro_batch_size", "global_batch_size",
                                              "lr", "data", "fp8") if getattr(args, k) is not None}
    try:
        if args.output:
            check_output(Path(args.output).expanduser(), overwrite=args.overwrite, writer="%mnb export -o",
                         flag="--overwrite")
        exported = export(args.kind, nodes=args.nodes, gpus_per_node=args.gpus_per_node, model=args.model,
                          layout=layout_from_flags(args), output=args.output, sbatch_options=args.sbatch_arg,
                          overwrite=args.overwrite, **settings)
    except (ValueError, OverwriteRefusedError) as exc:
        raise UsageError(str(exc)) from None
    if args.output:
        then = {"slurm": f"; submit it with: sbatch {args.output}", "torchrun": f"; run it: bash {args.output}"}
        print(f"wrote {args.output}: {args.kind} for {exported.model.name}, {exported.layout.describe()} on "
              f"{exported.nodes} node(s) x {exported.gpus_per_node} GPU(s)" + then.get(args.kind, ""))
    else:
        print(exported.text, end="")


def plan_command(args: argparse.Namespace, pool: Pool | None) -> None:
    from mnb.estimate import plan
    from mnb.plot import plot_plan

    gpu = calibrated_gpu(pool) if args.calibrate else args.gpu
    try:
        model = args.model
        if args.fp8:
            from mnb.model_source import resolve_model

            model = resolve_model(model).with_overrides(fp8=args.fp8)
        rows = plan(model, args.gpus, gpu=gpu, seq=args.seq, mbs=args.mbs, gbs=args.gbs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    from mnb.estimate import format_plan

    print(format_plan(rows[: args.top]))
    plot_plan(rows)


def calibrated_gpu(pool: Pool | None) -> str:
    """Measure the live pool (mnb.megatron.calibrate), register it as a device, return its name."""
    from mnb.estimate.measured import describe, register_measurement

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
