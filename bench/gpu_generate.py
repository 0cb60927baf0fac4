"""Decode throughput of ``mnb.generate`` on one GPU against transformers' ``generate``, same GPU, same call.

    python3 bench/gpu_generate.py --out gpu-out/generate.json

A random-weight Llama-3.2-1B-shaped model (mnb's ``llama-1b`` preset: 16 layers, hidden 2048, GQA 32/8,
vocabulary 128256, untied) in bf16; prompts of 128 random tokens, 256 new tokens, greedy, batch 1 and 32.
mnb runs in a 1-rank pool (``Pool.start(1, gpus=[0])``, the cell a notebook would run); transformers
(``attn_implementation="sdpa"``, bf16) runs in this process afterwards, on the same GPU.  Time to first
token: a call with ``max_new_tokens=1`` (prefill and one token).  tokens/s: new tokens / wall time of
the whole 256-token call (prefill included).  Each number is the median of 3 calls after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT, NEW, BATCHES, REPEATS = 128, 256, (1, 32), 3

RANK_CODE = f"""
import time, statistics, torch
model = mnb.gpt("llama-1b", fusions=FUSIONS)
for chunk in model.chunks:
    chunk.bfloat16()

def timed(batch, stream=False):
    prompts = torch.randint(0, 128000, (batch, {PROMPT}), generator=torch.Generator().manual_seed(batch)).tolist()
    mnb.generate(model, prompts, max_new_tokens=8, stream=False)  # warm-up: allocator, kernels
    def once(new, s):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = mnb.generate(model, prompts, max_new_tokens=new, stream=s)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, sum(len(o) for o in out)
    ttft = statistics.median(once(1, False)[0] for _ in range({REPEATS}))
    runs = [once({NEW}, stream) for _ in range({REPEATS})]
    total = statistics.median(t for t, _ in runs)
    tokens = runs[0][1]
    return dict(batch=batch, stream=stream, ttft_s=ttft, total_s=total, new_tokens=tokens,
                tokens_per_s=tokens / total, first_tokens=prompts[0][:4])
"""


def hf_rows(batches) -> list[dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                         rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    rows = []
    for batch in batches:
        prompts = torch.randint(0, 128000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).cuda()
        mask = torch.ones_like(prompts)

        def once(new):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompts, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                     min_new_tokens=new, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - t0, (out.shape[1] - PROMPT) * batch

        once(8)
        ttft = statistics.median(once(1)[0] for _ in range(REPEATS))
        runs = [once(NEW) for _ in range(REPEATS)]
        total = statistics.median(t for t, _ in runs)
        rows.append(dict(batch=batch, ttft_s=ttft, total_s=total, new_tokens=runs[0][1],
                         tokens_per_s=runs[0][1] / total))
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-out/generate.json")
    parser.add_argument("--fusions", default="auto")
    args = parser.parse_args()
    from mnb.controller import Pool

    result: dict = {"prompt": PROMPT, "new": NEW}
    pool = Pool.start(1, gpus=[0], timeout=600)
    try:
        fusions = args.fusions if args.fusions == "auto" else args.fusions == "true"
        t0 = time.perf_counter()
        pool.run(RANK_CODE.replace("FUSIONS", repr(fusions)), quiet=True, timeout=600)
        result["build_s"] = time.perf_counter() - t0
        rows = [pool.run(f"timed({b})", quiet=True, timeout=600)[0] for b in BATCHES]
        rows.append(pool.run("timed(1, stream=True)", quiet=True, timeout=600)[0])
        result["mnb"] = rows
        print(json.dumps(rows, indent=1), flush=True)
    finally:
        pool.stop()
    result["transformers"] = hf_rows(BATCHES)
    for m, h in zip(result["mnb"], result["transformers"]):
        m["vs_transformers"] = round(m["tokens_per_s"] / h["tokens_per_s"], 2)
        m["ttft_vs_transformers"] = round(m["ttft_s"] / h["ttft_s"], 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
