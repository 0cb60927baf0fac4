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
3. **Generate.** ``mnb.generate`` (greedy, token-id prompts of 128 tokens, 256 new tokens, batch 1
   and 32) against transformers' ``generate`` (sdpa attention, bf16, ``do_sample=False``) in a
   separate process on the same GPU, in the same call: new tokens per second and time to first
   token (a call with ``max_new_tokens=1``).

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
PROMPT_TOKENS, NEW_TOKENS = 128, 256


def build_checkpoint(size: str, folder: Path, device: str = "cuda") -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001, **SHAPES[size])
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


HF_GENERATE = r"""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
folder, batches, prompt, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
rows = []
for b in batches:
    ids = torch.randint(0, 128000, (b, prompt), generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(do_sample=False, pad_token_id=0)
    model.generate(ids, max_new_tokens=8, **kw)              # warm-up
    torch.cuda.synchronize(); t = time.perf_counter()
    model.generate(ids, max_new_tokens=1, **kw); torch.cuda.synchronize(); ttft = time.perf_counter() - t
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw); torch.cuda.synchronize()
    dt = time.perf_counter() - t
    n = (out.shape[1] - prompt) * b
    rows.append({"batch": b, "new_tokens": n, "s": round(dt, 3), "tokens_per_s": round(n / dt, 1),
                 "ttft_s": round(ttft, 4)})
print("ROWS " + json.dumps(rows))
"""


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
            if "generate" in sections:
                try:
                    pool.run("model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
                             f"model = mnb.from_hf({str(folder)!r})\n"
                             "import time\ngen_rows = []\n"
                             "for b in (1, 32):\n"
                             f"    ids = torch.randint(0, 128000, (b, {PROMPT_TOKENS}), "
                             "generator=torch.Generator().manual_seed(1)).tolist()\n"
                             "    mnb.generate(model, ids, max_new_tokens=8, stream=False)\n"
                             "    torch.cuda.synchronize(); t = time.perf_counter()\n"
                             "    mnb.generate(model, ids, max_new_tokens=1, stream=False)\n"
                             "    torch.cuda.synchronize(); ttft = time.perf_counter() - t\n"
                             "    t = time.perf_counter()\n"
                             f"    out = mnb.generate(model, ids, max_new_tokens={NEW_TOKENS}, stream=False)\n"
                             "    torch.cuda.synchronize(); dt = time.perf_counter() - t\n"
                             "    n = sum(len(o) for o in out)\n"
                             "    gen_rows.append({'batch': b, 'new_tokens': n, 's': round(dt, 3), "
                             "'tokens_per_s': round(n / dt, 1), 'ttft_s': round(ttft, 4)})", quiet=True)
                    mnb_rows = pool.pull("gen_rows")[0]
                    pool.run("model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()", quiet=True)
                    proc = subprocess.run([sys.executable, "-c", HF_GENERATE, str(folder), "[1, 32]",
                                           str(PROMPT_TOKENS), str(NEW_TOKENS)],
                                          capture_output=True, text=True, timeout=400, env=dict(os.environ))
                    hf_rows = next((json.loads(line[5:]) for line in proc.stdout.splitlines()
                                    if line.startswith("ROWS ")), None)
                    if hf_rows is None:
                        bench.add("generate", {"size": size, "transformers_error": proc.stderr[-2000:]})
                        hf_rows = [{}] * len(mnb_rows)
                    for m, h in zip(mnb_rows, hf_rows):
                        ratio = (round(m["tokens_per_s"] / h["tokens_per_s"], 2) if h.get("tokens_per_s") else None)
                        bench.add("generate", {"size": size, "batch": m["batch"], "mnb": m, "transformers": h,
                                               "mnb_over_transformers": ratio})
                except Exception:
                    bench.add("generate", {"size": size, "error": traceback.format_exc()[-2000:]})
            for f in folder.glob("*"):
                f.unlink()
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
