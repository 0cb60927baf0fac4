"""``mnb.from_hf`` against the raw read of the same safetensors files, on one GPU (issue 40, part 3).

    python3 bench/gpu_load.py --out $OUT [--sizes 1b,3b] [--repeats 3]

Random-weight checkpoints with the Llama-3.2-1B and -3B shapes (bench/hf_gpu.py's ``build_checkpoint``:
transformers on the GPU, bf16, 2 GB shards with their index) are written in a child process while a
one-rank pool starts (``standby="off"``: nothing else runs beside the measurements).  Then, per size,
each side in its own process with the machine to itself, median of ``--repeats`` from the page cache:

- **raw read** (a child process): every tensor through ``safe_open(...).get_tensor(name).clone()`` (the
  issue's baseline, as bench/hf_gpu.py: ``get_tensor`` alone maps the file and reads nothing until the
  clone copies every byte into host memory), and every byte of every shard through ``readinto`` of one
  64 MiB buffer (the page cache's or disk's own speed, one thread);
- **from_hf** (the pool's rank): ``mnb.from_hf(folder, fusions=False)`` until the weights are on the GPU
  (``torch.cuda.synchronize``; model building included), the rank's resident host memory (VmRSS) and peak
  (``ru_maxrss``) before and after, and what its one pass read (``model.hf.read``).

Cold (from disk): the page cache is dropped first (``/proc/sys/vm/drop_caches`` where permitted, else
``posix_fadvise(DONTNEED)`` of each shard after ``os.sync``; the row says which), once per side.
Writes OUT/gpu_load.json and prints one line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_measure import Rows  # noqa: E402

BUILD = """
import sys, json
from pathlib import Path
sys.path.insert(0, {here!r})
from hf_gpu import build_checkpoint
import platform, safetensors, torch, transformers
built = {{s: build_checkpoint(s, Path(f), sys.argv[2]) for s, f in json.loads(sys.argv[1]).items()}}
built["versions"] = dict(python=platform.python_version(), torch=torch.__version__,
                         transformers=transformers.__version__, safetensors=safetensors.__version__)
print("BUILT " + json.dumps(built))
"""

RAW = r"""
import json, statistics, sys, time
from pathlib import Path
from safetensors import safe_open
folder, repeats = Path(sys.argv[1]), int(sys.argv[2])
files = sorted(folder.glob("*.safetensors"))
def tensors():
    t = time.perf_counter()
    n = 0
    for f in files:
        with safe_open(f, "pt") as shard:
            for name in shard.keys():
                n += shard.get_tensor(name).clone().numel()  # get_tensor maps; clone reads every byte
    return time.perf_counter() - t
def whole():
    buf = bytearray(64 * 2**20)
    view = memoryview(buf)
    t = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(view):
                pass
    return time.perf_counter() - t
out = {"get_tensor_s": [tensors() for _ in range(repeats)], "readinto_s": [whole() for _ in range(repeats)]}
print("RAW " + json.dumps(out))
"""

LOAD = """
import gc, resource, time
model = None
gc.collect(); torch.cuda.empty_cache()
def _vmrss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
rss_before, peak_before = _vmrss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
_sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
_sync(); t0 = time.perf_counter()
model = mnb.from_hf({folder!r}, fusions=False)
_sync(); load_s = time.perf_counter() - t0
_log = model.hf.read
load_row = dict(load_s=load_s, rss_before=rss_before, rss_after=_vmrss(), peak_before=peak_before,
                peak_after=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, read_bytes=_log.bytes_read,
                pass_s=_log.seconds, host_buffer_bytes=_log.host_buffer_bytes, staged_peak_bytes=_log.staged_peak_bytes,
                param_dtype=str(next(model.chunks[0].parameters()).dtype))
"""


def drop_cache(folder: Path) -> str:
    """Evict the shards from the page cache; says how."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError as exc:
        how = f"fadvise DONTNEED (drop_caches: {exc.strerror or exc})"
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return how


def raw(folder: Path, repeats: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", RAW, str(folder), str(repeats)], capture_output=True, text=True,
                          timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RAW ")), None)
    if line is None:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(line[4:])


def _load(pool, folder: Path) -> dict:
    pool.run("model = None\nimport gc; gc.collect()", quiet=True)
    pool.run(LOAD.format(folder=str(folder)), quiet=True)
    return pool.pull("load_row")[0]


def warm(bench: Rows, pool, size: str, folder: Path, repeats: int) -> None:
    r = raw(folder, repeats)
    loads = [_load(pool, folder) for _ in range(repeats)]
    load_s = statistics.median(x["load_s"] for x in loads)
    get_s, read_s = statistics.median(r["get_tensor_s"]), statistics.median(r["readinto_s"])
    first, last = loads[0], loads[-1]
    gib = lambda b: round(b / 2**30, 2)  # noqa: E731
    bench.add("warm", {
        "size": size, "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
        "get_tensor_s": round(get_s, 3), "readinto_s": round(read_s, 3), "from_hf_s": round(load_s, 3),
        "from_hf_runs_s": [round(x["load_s"], 3) for x in loads],
        "one_pass_s": round(statistics.median(x["pass_s"] for x in loads), 3),
        "over_get_tensor": round(load_s / get_s, 2), "over_readinto": round(load_s / read_s, 2),
        "first_rss_GiB": [gib(first["rss_before"]), gib(first["rss_after"])],
        "last_rss_GiB": [gib(last["rss_before"]), gib(last["rss_after"])],
        "peak_rss_GiB": [gib(first["peak_before"]), gib(last["peak_after"])],
        "read_bytes": last["read_bytes"], "host_buffer_MiB": last["host_buffer_bytes"] / 2**20,
        "staged_peak_MiB": round(last["staged_peak_bytes"] / 2**20, 1), "params": last["param_dtype"]})


def cold(bench: Rows, pool, size: str, folder: Path) -> None:
    how = drop_cache(folder)
    r = raw(folder, 1)
    how2 = drop_cache(folder)
    load = _load(pool, folder)
    bench.add("cold", {"size": size, "evicted_by": how if how == how2 else [how, how2],
                       "get_tensor_s": round(r["get_tensor_s"][0], 3), "from_hf_s": round(load["load_s"], 3),
                       "over_get_tensor": round(load["load_s"] / r["get_tensor_s"][0], 2)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-load-out"))
    ap.add_argument("--sizes", default="1b,3b")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (--sizes tiny)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Rows(args.out, "gpu_load.json")
    root = Path(tempfile.mkdtemp(prefix="mnb-load-bench-"))
    sizes = args.sizes.split(",")
    folders = {s: str(root / f"llama-3.2-{s}-random") for s in sizes}
    t0 = time.perf_counter()
    builder = subprocess.Popen([sys.executable, "-c", BUILD.format(here=str(HERE)), json.dumps(folders), args.device],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    from mnb.controller import Pool

    where = dict(gpus=[0]) if args.device == "cuda" else dict(device="cpu")
    pool = Pool.start(1, timeout=600, standby="off", **where)
    try:
        bench.add("setup", {"pool_start_s": round(time.perf_counter() - t0, 1)})
        out, err = builder.communicate(timeout=600)
        line = next((x for x in out.splitlines() if x.startswith("BUILT ")), None)
        if line is None:
            raise RuntimeError(err[-3000:])
        bench.add("setup", {"built": json.loads(line[6:]), "since_start_s": round(time.perf_counter() - t0, 1)})
        pool.run("import mnb, torch", quiet=True)
        for size in sizes:
            try:
                warm(bench, pool, size, Path(folders[size]), args.repeats)
            except Exception:
                bench.add("error", {"size": size, "error": traceback.format_exc()[-2000:]})
        for size in [] if args.no_cold else sizes:
            try:
                cold(bench, pool, size, Path(folders[size]))
            except Exception:
                bench.add("error", {"size": size, "error": traceback.format_exc()[-2000:]})
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
