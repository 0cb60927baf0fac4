"""Issue 39, item 2: ``%mnb start`` -> ready and -> first step in three orders, against a cold torchrun.

One H200 call (the device machine runs the session's main checkout at the top and this branch's copy
under ``.dev/i39-start``; each code's rows come from its own tree)::

    python3 bench/start_orders.py --drop-page-cache --out $OUT/start --code main=$ROOT --code branch=$PWD

This CPU machine (2 CPU ranks, a tiny model, ``--standby on`` where the order has a standby: CPU
pools choose ``auto`` = off on a machine this small)::

    PYTHONPATH=$PWD python3 bench/start_orders.py --cpu --out /tmp/start --code main=/work/main --code branch=$PWD

Each run is a fresh Python process (a fresh kernel) with a fresh compile cache (``XDG_CACHE_HOME``),
driving the pool API as the magics do (``load_standby.begin`` is what ``%load_ext mnb`` calls;
``Pool.start()`` is a bare ``%mnb start``), and the page cache dropped first where the machine allows
it and ``--drop-page-cache`` asks (``/proc/sys/vm/drop_caches``; the row says whether it did):

- ``at-once``: ``%load_ext mnb`` (the load-time standby begins), ``%mnb start`` at once;
- ``after-20s``: ``%load_ext mnb``, 20 s of the user reading, then ``%mnb start``;
- ``off``: no standby at all (``MNB_STANDBY_AT_LOAD=0``, ``--standby off``), ``%mnb start``.

Then at once the first cell: the model and one training step (GPU: llama-1b, 8 layers, seq 2048,
micro batch 4, bf16, the fused kernels compiling in the background; CPU: tiny, 2 layers).  Rows:
start -> ready, start -> first step done, the start's note (adopted the standby or not), the line the
first cell printed while it waited, and ``--timings``.  Last, a cold ``torchrun`` of the same step with
Megatron's own ops (``bench/plain_torchrun.py --no-fusions``): launch -> first step done.  The goals:
ready <= 6 s in every order; first step <= 0.8x the cold torchrun.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDERS = ("off", "at-once", "after-20s")
READING_S = 20.0
"""The user's seconds between ``%load_ext mnb`` and ``%mnb start`` in the ``after-20s`` order."""
GPU_CELL = ("model = mnb.gpt('llama-1b', num_layers=8, seq_length=2048)\n"
            "mnb.train(model, steps=1, micro_batch_size=4, global_batch_size=4, bf16=True)")
CPU_CELL = ("model = mnb.gpt('tiny', num_layers=2, seq_length=64)\n"
            "mnb.train(model, steps=1, micro_batch_size=1, global_batch_size=2)")


DROP_PAGE_CACHE = False
"""``--drop-page-cache``: each run from a cold page cache (the device machine; never on a shared one)."""


def drop_page_cache() -> bool:
    """Drop the page cache when asked and allowed (root); whether it was dropped."""
    if not DROP_PAGE_CACHE:
        return False
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def one_run(order: str, cpu: bool, result: Path) -> None:
    """The child: one order in this fresh process; its row as JSON in ``result``."""
    import mnb
    from mnb.controller import Pool, load_standby
    from mnb.controller import standby as standbys

    row: dict = {"order": order, "mnb": mnb.__file__}
    t_load = time.perf_counter()
    if order != "off":
        row["standby_begun_at_load"] = load_standby.begin(pool_running=False)
    if order == "after-20s":
        time.sleep(READING_S)  # the user reads; the bench's own think time, not a synchronisation
        row["standby_at_start"] = (standbys.parked_status() or {}).get("state")
    standby = "off" if order == "off" else ("on" if cpu else "auto")
    t_start = time.perf_counter()
    pool = Pool.start(timeout=600, standby=standby)
    ready = time.perf_counter()
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            pool.run(CPU_CELL if cpu else GPU_CELL)
        first = time.perf_counter()
        run = mnb.last_run
        row.update({
            "start_to_ready_s": round(ready - t_start, 2), "start_to_first_step_s": round(first - t_start, 2),
            "first_cell_s": round(first - ready, 2), "load_to_first_step_s": round(first - t_load, 2),
            "start_note": pool.start_note, "printed": printed.getvalue()[-2000:],
            "step_s": round(run.step_times_s[0], 3) if run.step_times_s else None,
            "unfused_steps": getattr(run, "unfused_steps", None), "timings": pool.start_timings,
        })
    finally:
        pool.stop()
        parked = standbys.unpark()
        if parked is not None:
            parked.close()
    result.write_text(json.dumps(row, indent=1))


def run_child(order: str, label: str, tree: Path, cpu: bool, out: Path, extra_path: str) -> dict:
    result = out / f"{label}-{order}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), extra_path) if p)
    env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mnb-cold-cache-")  # an empty compile cache
    env["MNB_STANDBY_AT_LOAD"] = "0" if order == "off" else ("1" if cpu else "auto")
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(name, None)
    dropped = drop_page_cache()
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--one", order, "--result", str(result)]
                          + (["--cpu"] if cpu else []), env=env, cwd=str(tree), capture_output=True, text=True,
                          timeout=600)
    row = json.loads(result.read_text()) if result.exists() else {
        "order": order, "error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    row.update({"code": label, "page_cache_dropped": dropped, "process_s": round(time.perf_counter() - t, 1)})
    return row


def cold_torchrun(out: Path, tree: Path, cpu: bool, extra_path: str) -> dict:
    """bench/plain_torchrun.py (the branch's copy) with Megatron's own ops, launched cold."""
    result = out / "plain.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={2 if cpu else 1}", str(HERE / "plain_torchrun.py"), "--steps", "1", "--no-fusions",
           "--result", str(result)]
    cmd += (["--preset", "tiny", "--num-layers", "2", "--seq", "64", "--mbs", "1", "--gbs", "2", "--device", "cpu",
             "--fp32"] if cpu else ["--num-layers", "8", "--mbs", "4", "--gbs", "4"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tree), extra_path) if p))
    env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mnb-cold-cache-")
    dropped = drop_page_cache()
    env["MNB_LAUNCH_T"] = repr(time.time())
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode or not result.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    return {**json.loads(result.read_text()), "page_cache_dropped": dropped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="start-orders-out")
    parser.add_argument("--code", action="append", default=[],
                        help="LABEL=TREE: a checkout whose mnb runs the rows (repeat; default: this one)")
    parser.add_argument("--orders", default=",".join(ORDERS), help=f"comma-separated, of {', '.join(ORDERS)}")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cpu", action="store_true", help="2 CPU ranks and a tiny model (this machine)")
    parser.add_argument("--no-torchrun", action="store_true", help="leave out the cold torchrun row")
    parser.add_argument("--drop-page-cache", action="store_true",
                        help="drop the page cache before each run (a machine of its own, as root)")
    parser.add_argument("--one", choices=ORDERS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        one_run(args.one, args.cpu, Path(args.result))
        return
    sys.path.insert(0, str(HERE))
    from gpu_measure import Rows

    global DROP_PAGE_CACHE
    DROP_PAGE_CACHE = args.drop_page_cache
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    codes = [tuple(c.split("=", 1)) for c in args.code] or [("this", str(HERE.parent))]
    # what the device machine installs its wheels into (--target /tmp/site), without this tree's own path
    here = str(HERE.parent.resolve())
    extra_path = os.pathsep.join(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                 if p and Path(p).resolve() != here and Path(p).resolve() not in
                                 {Path(t).resolve() for _, t in codes})
    rows = Rows(out, "start_orders.json")
    for repeat in range(args.repeats):
        for order in args.orders.split(","):
            for label, tree in codes:  # interleaved: neither code always runs on the colder machine
                row = run_child(order, f"{label}{repeat}", Path(tree), args.cpu, out, extra_path)
                rows.add(order, {k: v for k, v in row.items() if k not in ("timings", "printed")})
                rows.add("detail", row)
    if not args.no_torchrun:
        rows.add("cold torchrun", cold_torchrun(out, Path(codes[-1][1]), args.cpu, extra_path))


if __name__ == "__main__":
    main()
