"""The pool's failure paths on CUDA ranks (NCCL), in one run on the device machine (1 GPU).

    PYTHONPATH=. python bench/gpu_recovery.py --out OUTDIR

What the CPU tests check with gloo, checked once where NCCL and CUDA make it
different: a cell error, a Kernel -> Interrupt during ``mnb.train`` (SIGINT in
the controller's main thread, as ipykernel delivers it), a rank blocked in a
CUDA synchronize past ``--timeout`` (cannot be released: the pool restarts it),
a rank that exits, ``mnb.save`` on megatron-core 0.19 followed by ``stop()``
(its checkpoint helper processes must go too), a controller SIGKILLed during
training (every process gone within 5 s), and which addresses the pool's
processes listen on.  Each row: what was done, what was seen, seconds.
"""

from __future__ import annotations

import _thread
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from mnb.controller import Pool
from mnb.errors import CellTimeoutError, CompositeRankError, RankDiedError
from tests.conftest import alive_pids

ROWS: list[dict] = []


def row(check: str, seen: str, seconds: float, ok: bool) -> None:
    ROWS.append({"check": check, "seen": seen, "seconds": round(seconds, 2), "ok": ok})
    print(f"{'ok ' if ok else 'BAD'} {check}: {seen} ({seconds:.2f} s)", flush=True)


def timed(fn):
    t0 = time.perf_counter()
    try:
        return fn(), None, time.perf_counter() - t0
    except BaseException as exc:  # the checks look at the exception
        return None, exc, time.perf_counter() - t0


MODEL = "model = mnb.gpt('llama-1b', num_layers=2, seq_length=512, fusions=False)"
TRAIN = "mnb.train(model, steps=100000, micro_batch_size=2, global_batch_size=2, bf16=True)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)

    pool, _, seconds = timed(lambda: Pool.start(1, device="cuda", timeout=300))
    row("start 1 CUDA rank", repr(pool), seconds, pool is not None)
    listening = sorted({c.laddr.ip for pid in pool.descendants() for c in psutil.Process(pid).net_connections("inet")
                        if c.status == psutil.CONN_LISTEN})
    row("listening addresses of the pool's processes", ", ".join(listening), 0, listening == ["127.0.0.1"])

    _, exc, seconds = timed(lambda: pool.run("raise ValueError('root cause')"))
    row("cell error", f"{type(exc).__name__}: {str(exc).splitlines()[-1].strip()}", seconds,
        isinstance(exc, CompositeRankError))
    pool.run(MODEL)
    for delay in (1.0, 2.5, 4.0):
        threading.Timer(delay, _thread.interrupt_main).start()
        _, exc, seconds = timed(lambda: pool.run(TRAIN, quiet=True))
        steps = pool.run("model.steps_done")[0]
        row(f"interrupt after {delay} s of mnb.train", str(exc), seconds,
            isinstance(exc, KeyboardInterrupt) and "stopped after step" in str(exc) and pool.restarts == 0)
    result, exc, seconds = timed(lambda: pool.run("len(mnb.train(model, steps=3, micro_batch_size=2, "
                                                  "global_batch_size=2, bf16=True)['steps'])"))
    row("training continues after the interrupts", f"{result} steps from steps_done={steps}", seconds, result == {0: 3})

    blocked = "torch.cuda._sleep(int(2e12))\ntorch.cuda.synchronize()"
    _, exc, seconds = timed(lambda: pool.run(blocked, timeout=3))
    row("rank blocked in cuda.synchronize past --timeout 3", str(exc).splitlines()[-1], seconds,
        isinstance(exc, CellTimeoutError) and "restarting all 1 ranks" in str(exc))
    result, _, seconds = timed(lambda: pool.run("rank"))
    row("next cell after the automatic restart (waits for it)", f"{result}, restarts={pool.restarts}", seconds,
        result == {0: 0})

    _, exc, seconds = timed(lambda: pool.run("import os\nos._exit(3)"))
    row("rank exits with code 3", str(exc).splitlines()[0], seconds,
        isinstance(exc, RankDiedError) and "exit code 3" in str(exc))
    result, _, seconds = timed(lambda: pool.run("rank"))
    row("next cell after the death", f"{result}, restarts={pool.restarts}", seconds, result == {0: 0})

    ckpt = Path(tempfile.mkdtemp(prefix="mnb-ck-")) / "ck"
    before = set(pool.descendants())
    pool.run(MODEL + f"\nmnb.save({str(ckpt)!r}, model)")
    after = set(pool.descendants())
    pids = sorted(after)
    started = time.perf_counter()
    workdir = pool.workdir()
    pool.stop()
    left = alive_pids(pids)
    row("mnb.save (megatron-core 0.19), then stop()",
        f"{len(after - before)} process(es) started by the save; left after stop: {left}; "
        f"folder left: {workdir.exists()}", time.perf_counter() - started, not left and not workdir.exists())

    script = ("import json, time\nfrom mnb.controller import Pool\npool = Pool.start(1, device='cuda', timeout=300)\n"
              f"pool.run({MODEL!r}, quiet=True)\nprint(json.dumps([pool.descendants(), str(pool.workdir())]), flush=True)\n"
              f"pool.run({TRAIN!r}, quiet=True)\n")
    controller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids, workdir = json.loads(controller.stdout.readline())
    time.sleep(5)
    os.kill(controller.pid, signal.SIGKILL)  # left unreaped: a zombie, as a killed kernel often is
    started = time.perf_counter()
    while alive_pids(pids) and time.perf_counter() - started < 15:
        time.sleep(0.1)
    gone_s = time.perf_counter() - started
    left = alive_pids(pids)
    controller.wait()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    row("controller SIGKILLed during training (zombie)", f"{len(pids)} processes; left: {left}; "
        f"folder left: {os.path.exists(workdir)}", gone_s, not left and gone_s <= 5 and not os.path.exists(workdir))

    (out / "gpu_recovery.json").write_text(json.dumps(ROWS, indent=1))
    lines = ["| check | seen | s | ok |", "|---|---|---|---|"]
    lines += [f"| {r['check']} | {r['seen']} | {r['seconds']} | {'yes' if r['ok'] else 'NO'} |" for r in ROWS]
    (out / "gpu_recovery.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
