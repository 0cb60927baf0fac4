"""Hugging Face checkpoints on one H200 (issues 24 and 25): every measurement in one device call.

    python bench/hf_gpu.py --out OUTDIR [--sizes 1b,3b] [--sections load,finetune,generate]

1. **Load.** A random-weight checkpoint with the Llama-3.2-1B (and 3B) shape is built with
   transformers on the GPU and saved in Hugging Face format (bf16 safetensors, 2 GB shards with
   their index) inside the benchmark; then the raw read of the same files
   (``safetensors.torch.load_file`` of every shard, warm page cache as for the load that follows)
   (every tensor copied into host memory) against ``mnb.from_hf`` on a one-rank pool, and the rank's peak host memory (``ru_maxrss``)
   before and after the load.
2. **Fine-tune.** ``mnb.train`` on the loaded model (bf16, 6 steps, micro batch 8, 8 microbatches,
   seq 2048) beside ``mnb.gpt("llama-1b"/"llama-3b")`` with the same settings: MFU against the
   measured 790 TFLOP/s GEMM peak (bench/gpu_measure.py's ``run_row``).
3. **Generate.** ``mnb.generate`` on the loaded model (greedy, token-id prompts of 128 tokens, 256
   new tokens, batch 1 and 32; its background compile waited for) against transformers' ``generate``
   of the same checkpoint, dynamic cache and static-cache recipe, each after the pool has stopped, in
   its own process (bench/gpu_generate.py's sides: the same call, median of 3 after a warm-up).

Uses the pool API (the device machine has no IPython; ``%%megatron`` calls the same methods).
Writes OUTDIR/hf_gpu.json and prints one line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_generate import BATCHES, MNB_TIMED  # noqa: E402
from gpu_measure import Rows, run_row  # noqa: E402

SHAPES = {  # the Llama-3.2 configs' shapes (tied embeddings, llama3 RoPE scaling), random weights
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,  # smoke tests
                 num_key_value_heads=2, head_dim=16),
}
PRESET = {"1b": "llama-1b", "3b": "llama-3b"}
TRAIN = "steps=6, micro_batch_size={mbs}, global_batch_size={gbs}, bf16=True"


def build_checkpoint(size: str, folder: Path, device: str = "cuda", *, vocab: int = 128256, bos: int = 128000,
                     eos: int = 128001) -> dict:
    """A random-weight Llama-3.2-shaped bf16 checkpoint of ``SHAPES[size]`` in ``folder`` (2 GB shards)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos, **SHAPES[size])
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="2GB")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    files = sorted(folder.glob("*.safetensors"))
    return {"build_and_save_s": round(time.perf_counter() - start, 1), "shards": len(files),
            "bytes": sum(f.stat().st_size for f in files)}


def raw_read_s(folder: Path) -> float:
    """Every shard's tensors read into host memory (``safe_open(...).get_tensor`` copies each one
    out of the file: ``load_file`` alone maps the file and reads nothing until a tensor is used)."""
    from safetensors import safe_open

    start = time.perf_counter()
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as shard:
            for name in shard.keys():
                shard.get_tensor(name).clone()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("hf-gpu-out"))
    ap.add_argument("--sizes", default="1b,3b")
    ap.add_argument("--sections", default="load,finetune,generate")
    ap.add_argument("--mbs", type=int, default=8)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))
    bench = Rows(args.out, "hf_gpu.json")
    root = Path(tempfile.mkdtemp(prefix="mnb-hf-bench-"))

    from mnb.controller import Pool

    later: list[tuple[str, Path]] = []  # checkpoints whose transformers generate runs after the pool
    pool = Pool.start(1, gpus=[0], timeout=600)
    try:
        for size in args.sizes.split(","):
            folder = root / f"llama-3.2-{size}-random"
            try:
                built = build_checkpoint(size, folder)
                raw = raw_read_s(folder)
                pool.run("import resource, time\nmodel = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
                         "rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
                         "t0 = time.perf_counter()\n"
                         f"model = mnb.from_hf({str(folder)!r})\n"
                         "torch.cuda.synchronize(); load_s = time.perf_counter() - t0\n"
                         "rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024", quiet=True)
                got = {k: v[0] for k, v in ((n, pool.pull(n)) for n in ("load_s", "rss_before", "rss_after"))}
                bench.add("load", {"size": size, **built, "raw_read_s": round(raw, 2),
                                   "from_hf_s": round(got["load_s"], 2),
                                   "from_hf_over_raw": round(got["load_s"] / raw, 2),
                                   "rank_peak_rss_GiB_before": round(got["rss_before"] / 2**30, 2),
                                   "rank_peak_rss_GiB_after": round(got["rss_after"] / 2**30, 2)})
            except Exception:
                bench.add("load", {"size": size, "error": traceback.format_exc()[-2000:]})
                continue
            if "finetune" in sections:
                train = TRAIN.format(mbs=args.mbs, gbs=8 * args.mbs)
                fresh = "model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
                for label, build in ((f"from_hf {size}", f"mnb.from_hf({str(folder)!r}, seq_length=2048)"),
                                     (PRESET[size], f"mnb.gpt({PRESET[size]!r}, seq_length=2048)")):
                    try:
                        pool.run(f"{fresh}model = {build}\nmnb.train(model, {train})", quiet=True)
                        import mnb

                        bench.add("finetune", {"model": label, **run_row(mnb.last_run, train)})
                    except Exception:
                        bench.add("finetune", {"model": label, "error": traceback.format_exc()[-2000:]})
            if "generate" in sections:  # mnb's side now; transformers' after the pool has stopped
                try:
                    pool.run(MNB_TIMED + "model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
                             f"model = mnb.from_hf({str(folder)!r})\n"
                             "pending = background_compile.pending()\n"
                             "pending is None or pending.wait(600)", quiet=True, timeout=900)
                    for batch in BATCHES:
                        row = pool.run(f"timed({batch})", quiet=True, timeout=600)[0]
                        bench.add("generate", {**row, "model": f"from_hf {size}"})
                    pool.run("model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()", quiet=True)
                    later.append((size, folder))
                    continue
                except Exception:
                    bench.add("generate", {"size": size, "error": traceback.format_exc()[-2000:]})
            for f in folder.glob("*"):
                f.unlink()
    finally:
        pool.stop()
    for side in ("hf-dynamic", "hf-static"):  # each in its own process, the GPU and CPUs to itself
        for size, folder in later:
            part = args.out / f"hf_gpu.{side}.{size}.jsonl"
            part.unlink(missing_ok=True)
            subprocess.run([sys.executable, str(HERE / "gpu_generate.py"), "--side", side, "--models",
                            f"from_hf {size}", "--hf-folders", json.dumps({f"from_hf {size}": str(folder)}),
                            "--out", str(part)], timeout=900, env=dict(os.environ))
            for line in (part.read_text().splitlines() if part.exists() else []):
                bench.add("generate", json.loads(line))
    for _, folder in later:
        for f in folder.glob("*"):
            f.unlink()


if __name__ == "__main__":
    main()
