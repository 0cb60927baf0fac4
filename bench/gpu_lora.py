"""LoRA against full fine-tuning, and against peft on transformers, on one H200 (issue 38): one device call.

    python3 bench/gpu_lora.py --out $OUT                                   # 1b and 3b, bf16, seq 2048
    python3 bench/gpu_lora.py --out /tmp/lora-smoke --sizes tiny --device cpu --seq 64 --mbs 2 --steps 2

1. **Data.** A byte-level BPE tokenizer (Llama 3's layout: BOS added, EOS named) trained here on
   generated text, and ``rows.jsonl``: prompt/completion rows whose completion is longer than a
   sequence, so that ``truncate=True`` cuts every example at ``seq + 1`` tokens: no padding on either
   side, the same tokens, the loss on completion tokens only.
2. **Checkpoints.** Llama-3.2-1B- and 3B-shaped models (bench/hf_gpu.py's shapes: tied embeddings,
   vocabulary 128,256, llama3 RoPE) built by transformers with random weights, saved in bf16 with the
   tokenizer beside them. No downloads.
3. **peft on transformers**, each size in its own process with the GPU to itself (before the pool
   starts): ``AutoModelForCausalLM`` in bf16 (sdpa attention), ``get_peft_model`` with rank 16,
   alpha 32 on all seven projections (peft's default fp32 adapters), fused AdamW, the same micro
   batch and number of microbatches (loss / m, backward, one optimizer step), ``model(ids, labels=)``.
4. **mnb**, a one-rank pool: ``mnb.from_hf`` then ``mnb.train`` (bf16) for full fine-tuning, and a
   fresh ``mnb.from_hf`` + ``mnb.lora(rank=16, alpha=32, targets="all-linear")`` + ``mnb.train``,
   ``pack=False, truncate=True`` (each sequence one example, cut at the sequence length).

Tokens/s: sequence tokens of a step over its time, the mean of the steps after the first.  MFU: model
FLOPs (``mnb.megatron.record.model_flops_per_step``: with LoRA the frozen weights' gradient GEMMs are
not counted, the adapters' are) over the measured 790 TFLOP/s bf16 GEMM peak; the same count for peft.
Peak memory: the CUDA allocator's peak; mnb's beside ``mnb.estimate.memory`` (``mnb.last_run.predicted_memory``).
Writes OUTDIR/gpu_lora.json (rows as they come) and prints a table with the issue's goals.
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

from gpu_measure import GIB, MEASURED_PEAK_FLOPS, Rows, run_row  # noqa: E402
from hf_gpu import build_checkpoint as hf_checkpoint  # noqa: E402

RANK, ALPHA = 16, 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORDS = ("rank", "layer", "weight", "token", "adapter", "pipeline", "tensor", "notebook", "answer", "shard",
         "gradient", "optimizer", "batch", "sequence", "kernel", "memory", "the", "a", "of", "and", "holds")


def texts(n: int, words: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "." for _ in range(n)]


def build_tokenizer(folder: Path) -> tuple[int, int]:
    """A Llama-3-layout tokenizer (BOS added by its post-processor) in ``folder``; (bos, eos) ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(200, 200, 0), trainers.BpeTrainer(
        vocab_size=512, special_tokens=[bos, eos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos_id, eos_id = tok.token_to_id(bos), tok.token_to_id(eos)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos}:0 $A:0", special_tokens=[(bos, bos_id)])])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "clean_up_tokenization_spaces": False, "model_max_length": 131072,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return bos_id, eos_id


def write_rows(path: Path, n: int, completion_words: int) -> None:
    """prompt/completion rows; each completion longer than a sequence (cut by ``truncate=True``)."""
    prompts, completions = texts(n, 12, 1), texts(n, completion_words, 2)
    with path.open("w") as f:
        for p, c in zip(prompts, completions):
            f.write(json.dumps({"prompt": "Q: " + p + "\nA:", "completion": " " + c}) + "\n")


def build_checkpoint(size: str, folder: Path, tokenizer: Path, device: str) -> dict:
    """bench/hf_gpu.py's checkpoint with this benchmark's tokenizer (its ids and files)."""
    import shutil

    bos, eos = json.loads((tokenizer / "ids.json").read_text())
    made = hf_checkpoint(size, folder, device, vocab=128256 if size != "tiny" else 1024, bos=bos, eos=eos)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return {"size": size, "build_and_save_s": made["build_and_save_s"], "bytes": made["bytes"]}


# ------------------------------------------------------------------------------ peft side
def peft_side(args) -> dict:
    """peft on transformers, this process alone on the device: the row of one size."""
    import torch
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mnb.config import LoraConfig
    from mnb.hf_config import hf_config
    from mnb.megatron.record import model_flops_per_step

    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(args.folder)
    seq, m = args.seq, args.gbs // args.mbs
    samples = []
    for line in Path(args.rows).read_text().splitlines():
        row = json.loads(line)
        prompt = tok(row["prompt"])["input_ids"]
        ids = (prompt + tok(row["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:seq]
        labels = [-100] * len(prompt) + ids[len(prompt):]
        samples.append((ids, labels))
        if len(samples) == args.gbs * args.steps:
            break
    assert all(len(ids) == seq for ids, _ in samples), "every row must fill a sequence (longer completions)"
    base = AutoModelForCausalLM.from_pretrained(args.folder, dtype=dtype, attn_implementation="sdpa").to(device)
    model = get_peft_model(base, PeftLora(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(TARGETS),
                                          task_type="CAUSAL_LM"))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=args.device == "cuda")
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(args.steps):
        start = time.perf_counter()
        total = 0.0
        for k in range(m):
            batch = samples[(step * m + k) * args.mbs:(step * m + k + 1) * args.mbs]
            ids = torch.tensor([b[0] for b in batch], device=device)
            labels = torch.tensor([b[1] for b in batch], device=device)
            loss = model(input_ids=ids, labels=labels).loss / m
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(round(total, 4))
    step_s = sum(times[1:]) / len(times[1:])
    cfg = hf_config(args.folder, seq_length=seq)
    flops = model_flops_per_step(cfg, args.gbs, cfg.vocab_size, LoraConfig(rank=RANK, alpha=ALPHA, targets=TARGETS))
    return {"side": "peft + transformers", "size": args.size, "trainable": trainable,
            "tokens_per_s": round(args.gbs * seq / step_s), "step_s": round(step_s, 3),
            "mfu_vs_790": round(flops / step_s / MEASURED_PEAK_FLOPS, 3), "losses": losses,
            "peak_GiB": round(torch.cuda.max_memory_allocated() / GIB, 2) if device.type == "cuda" else None,
            "versions": versions()}


def versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "peft", "megatron-core", "tokenizers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


# ------------------------------------------------------------------------------ mnb side
FRESH = "model = None\nimport gc; gc.collect()\nif torch.cuda.is_available(): torch.cuda.empty_cache()\n"


def mnb_row(pool, label: str, folder: Path, rows: Path, args, lora: bool) -> dict:
    import mnb

    train = (f"steps={args.steps}, micro_batch_size={args.mbs}, global_batch_size={args.gbs}, "
             f"bf16={args.device == 'cuda'}, data={str(rows)!r}, pack=False, truncate=True, lr=1e-4")
    adapt = (f"summary = mnb.lora(model, rank={RANK}, alpha={ALPHA}, targets='all-linear')\n"
             "trainable = summary.trainable\n") if lora else "trainable = None\n"
    pool.run(f"{FRESH}model = mnb.from_hf({str(folder)!r}, seq_length={args.seq})\n{adapt}"
             f"record = mnb.train(model, {train})\nlosses = [round(s['loss'], 4) for s in record['steps']]",
             quiet=True, timeout=600)
    run = mnb.last_run
    row = {"side": label, "size": args.size, "trainable": pool.pull("trainable")[0], **run_row(run, train),
           "losses": pool.pull("losses")[0]}
    row["mfu_vs_790"] = row.pop("mfu_vs_790")
    measured = run.first_record.get("memory_components") or {}
    predicted = run.predicted_memory.for_rank(0)
    row["components_GiB_measured"] = {k: round(v / GIB, 3) for k, v in measured.items()
                                      if isinstance(v, (int, float)) and k != "activations_per_microbatch"}
    row["components_GiB_predicted"] = {k: round(v / GIB, 3) for k, v in predicted.components().items()}
    return row


def table(rows: dict) -> str:
    mnb_rows = {(r["size"], r["side"]): r for r in rows.get("mnb", []) if "error" not in r}
    peft_rows = {r["size"]: r for r in rows.get("peft", []) if "error" not in r}
    lines = ["| size | run | tokens/s | MFU | peak measured | peak predicted | error |", "|---|---|---:|---:|---:|---:|---:|"]
    goals = []
    for size in sorted({s for s, _ in mnb_rows} | set(peft_rows)):
        full, lora, peft = mnb_rows.get((size, "mnb full")), mnb_rows.get((size, "mnb LoRA")), peft_rows.get(size)
        for name, r in (("mnb full fine-tuning", full), ("mnb LoRA r16", lora), ("peft + transformers r16", peft)):
            if r is None:
                continue
            meas = r.get("r0_meas_GiB", r.get("peak_GiB"))
            lines.append(f"| {size} | {name} | {r['tokens_per_s']:,} | {100 * r['mfu_vs_790']:.1f} % | {meas} GiB | "
                         f"{r.get('r0_pred_GiB', '—')} | {r.get('worst_mem_err', '—')} |")
        if full and lora:
            ratio = lora["r0_meas_GiB"] / full["r0_meas_GiB"]
            goals.append(f"{size}: LoRA peak / full peak = {ratio:.2f} (goal <= 0.6 at 3b: "
                         f"{'met' if ratio <= 0.6 else 'missed'})")
        if lora and peft:
            ratio = lora["tokens_per_s"] / peft["tokens_per_s"]
            goals.append(f"{size}: mnb LoRA / peft tokens/s = {ratio:.2f} (goal >= 1.5: {'met' if ratio >= 1.5 else 'missed'})")
        for r in (full, lora):
            if r:
                goals.append(f"{size} {r['side']}: memory predicted within {100 * r['worst_mem_err']:.1f} % "
                             f"(goal 5 %: {'met' if r['worst_mem_err'] <= 0.05 else 'missed'})")
    return "\n".join(lines + [""] + goals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-lora-out"))
    ap.add_argument("--sizes", default="1b,3b")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--side", default=None, help="internal: 'peft' runs one size's peft side in this process")
    ap.add_argument("--size", default=None)
    ap.add_argument("--folder", default=None)
    ap.add_argument("--rows", default=None)
    args = ap.parse_args()
    if args.side == "peft":
        print(json.dumps(peft_side(args)), flush=True)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Rows(args.out, "gpu_lora.json")
    root = Path(tempfile.mkdtemp(prefix="mnb-lora-bench-"))
    tokenizer = root / "tokenizer"
    (tokenizer / "ids.json").parent.mkdir(parents=True)
    (tokenizer / "ids.json").write_text(json.dumps(build_tokenizer(tokenizer)))
    rows = root / "rows.jsonl"
    write_rows(rows, args.gbs * args.steps, completion_words=args.seq)  # > seq tokens each
    bench.add("setup", {"versions": versions(), "seq": args.seq, "mbs": args.mbs, "gbs": args.gbs,
                        "steps": args.steps, "device": args.device})
    folders = {}
    for size in args.sizes.split(","):
        folders[size] = root / f"llama-3.2-{size}-random"
        bench.add("build", build_checkpoint(size, folders[size], tokenizer, args.device))
    for size, folder in folders.items():  # peft first, each in its own process: the device to itself
        cmd = [sys.executable, str(Path(__file__).resolve()), "--side", "peft", "--size", size, "--folder", str(folder),
               "--rows", str(rows), "--device", args.device, "--seq", str(args.seq), "--mbs", str(args.mbs),
               "--gbs", str(args.gbs), "--steps", str(args.steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ))
        try:
            bench.add("peft", json.loads(proc.stdout.strip().splitlines()[-1]))
        except (IndexError, ValueError):
            bench.add("peft", {"size": size, "error": f"exit {proc.returncode}: {proc.stderr[-2500:]}"})
    from mnb.controller import Pool

    pool = Pool.start(1, device=args.device, gpus=[0] if args.device == "cuda" else None, timeout=600,
                      standby="off")
    try:
        for size, folder in folders.items():
            args.size = size
            for label, lora in (("mnb full", False), ("mnb LoRA", True)):
                try:
                    bench.add("mnb", mnb_row(pool, label, folder, rows, args, lora))
                except Exception:
                    bench.add("mnb", {"side": label, "size": size, "error": traceback.format_exc()[-2500:]})
    finally:
        pool.stop()
    text = table(bench.rows)
    print(text, flush=True)
    (args.out / "gpu_lora.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
