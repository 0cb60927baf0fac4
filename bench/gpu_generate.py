"""Decode speed of ``mnb.generate`` against transformers' ``generate`` and the copy-bandwidth floor (issue 40).

    python3 bench/gpu_generate.py --out $OUT/generate.json [--models llama-1b,llama-3b]
        [--sides floor,mnb,hf-dynamic,hf-static] [--batches 1,32] [--check]
        [--baseline-decoder OLD_decode_graphs.py]

Random-weight Llama shapes (mnb's ``llama-1b`` / ``llama-3b`` presets: untied, RoPE base 500000) in bf16;
prompts of 128 random token ids (the same ids on every side), 256 new tokens, greedy, batch 1 and 32.

Fair by construction: every side runs in its own process, one after the other, with the GPU and the CPUs
to itself: ``mnb`` (a one-rank pool, ``Pool.start(1, gpus=[0])``, the cell a notebook runs; the pool's
background compile of the fused kernels waited for before any timing), ``hf-dynamic`` (transformers,
sdpa, its default dynamic cache), ``hf-static`` (transformers' static-cache recipe:
``cache_implementation="static"``, which compiles the forward), and ``floor`` (the copy bandwidth of
this GPU; the floor of a step reads every weight but the input embedding table once, plus the KV cache).
Each number is the median of 3 calls after a warm-up call of the same size (the warm-up of mnb and of
hf-static includes the capture / compile, reported as ``first_call_s``).  tokens/s = new tokens / wall time
of the whole call (prefill included); time to first token: mnb a call with ``max_new_tokens=1``,
transformers the time its streamer receives the first new token (its static cache keeps one compile).
``--check`` adds a GPU check that the graph path chooses the tokens of the per-token path, and on the
first model the kernels per decoded token (the step run uncaptured under the profiler) and the rows of
``decode_graphs.sdpa_decode``.  ``--baseline-decoder FILE`` (e.g. ``git show REV:mnb/megatron/decode_graphs.py``)
measures that version of the decode path too, on the first model, in the same pool (``mnb-baseline`` rows);
``--variants compile_step,own_kernels=0,...`` measures the path with each of those ``decode_graphs`` flags on
(or off: ``=0``; ``mnb-<flag>`` rows), and ``--profile`` gives the GPU time per decoded token by kernel name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT, NEW, REPEATS = 128, 256, 3
BATCHES = (1, 32)  # --batches


def prompts(batch: int) -> list[list[int]]:
    import torch

    return torch.randint(0, 128000, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).tolist()


def shape(preset: str) -> dict:
    from mnb.config import load_preset

    c = load_preset(preset)
    return dict(layers=c.num_layers, hidden=c.hidden_size, heads=c.num_attention_heads, groups=c.num_query_groups,
                ffn=c.ffn_hidden_size, vocab=c.vocab_size, tied=c.share_embeddings_and_output_weights,
                rope_base=c.rotary_base)


def weights_read_bytes(s: dict) -> int:
    """bf16 bytes a decode step reads: every weight once, but only one row per token of the input table."""
    hd = s["hidden"] // s["heads"]
    layer = s["hidden"] * (s["hidden"] + 2 * s["groups"] * hd) + s["hidden"] ** 2 + 3 * s["hidden"] * s["ffn"] \
        + 2 * s["hidden"]
    return 2 * (s["layers"] * layer + s["vocab"] * s["hidden"] + s["hidden"])


def kv_bytes(s: dict, batch: int, positions: int) -> int:
    return 2 * 2 * s["layers"] * s["groups"] * (s["hidden"] // s["heads"]) * positions * batch


# ----------------------------------------------------------------------------------- sides
PART: Path | None = None  # a side process appends its rows here as they come (a timeout keeps them)


def emit(rows: list[dict], row: dict) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)
    if PART is not None:
        with PART.open("a") as f:
            f.write(json.dumps(row) + "\n")


def side_floor(models: list[str]) -> list[dict]:
    import torch

    n = 2 * 2**30  # 2 GiB
    a = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    bandwidth = 2 * n / statistics.median(times)  # read + write
    rows = []
    for model in models:
        s = shape(model)
        for batch in BATCHES:
            step = (weights_read_bytes(s) + kv_bytes(s, batch, PROMPT + NEW // 2)) / bandwidth
            emit(rows, dict(side="floor", model=model, batch=batch, copy_TBps=round(bandwidth / 1e12, 2),
                            weights_GB=round(weights_read_bytes(s) / 1e9, 2), step_ms=round(step * 1e3, 3),
                            tokens_per_s=round(batch / step, 1)))
    return rows


MNB_TIMED = f"""
import statistics, time, torch
from mnb.megatron import background_compile, decode_graphs

def timed(batch, new={NEW}):
    ids = torch.randint(0, 128000, (batch, {PROMPT}), generator=torch.Generator().manual_seed(batch)).tolist()
    def once(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = mnb.generate(model, ids, max_new_tokens=n, stream=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0, sum(len(o) for o in out), out
    first = once(new)[0]  # captures this bucket's graphs
    ttft = statistics.median(once(1)[0] for _ in range({REPEATS}))
    runs = [once(new) for _ in range({REPEATS})]
    total = statistics.median(t for t, _, _ in runs)
    return dict(side="mnb", batch=batch, first_call_s=round(first, 3), ttft_s=round(ttft, 4), total_s=round(total, 3),
                new_tokens=runs[0][1], tokens_per_s=round(runs[0][1] / total, 1), first_ids=runs[0][2][0][:8],
                own_kernels=model.decoder.kernels if model.decoder is not None else None,
                capture_notes=list(model.decoder.capture_notes) if model.decoder is not None else None)

def kernels(batch, steps=16):
    # GPU work items (kernels, memsets, copies) per decoded token: the same step run uncaptured (a fresh
    # decoder with capture off) under the profiler: (a call of 1 + steps tokens) - (a call of 1 token),
    # over steps; the host sync every SYNC_EVERY tokens included.
    from torch.profiler import ProfilerActivity, profile
    ids = torch.randint(0, 128000, (batch, {PROMPT}), generator=torch.Generator().manual_seed(batch)).tolist()
    model.decoder = None
    decode_graphs.decoder_of(model).capture = False
    mnb.generate(model, ids, max_new_tokens=1, stream=False)  # the bucket's buffers made
    def count(n):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            mnb.generate(model, ids, max_new_tokens=n, stream=False)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    try:
        return dict(side="kernels", batch=batch, per_token=round((count(1 + steps) - count(1)) / steps, 1))
    finally:
        model.decoder = None

def kernel_table(batch, steps=16, top=40):
    # GPU time per decoded token by kernel name (the step uncaptured, as kernels()), and the sum: what the
    # kernels themselves take, against the captured step's wall time per token (the gaps between them).
    # Not for compile=True: uncaptured steps are not compiled (and a profiled compile measures itself)
    from torch.profiler import ProfilerActivity, profile
    ids = torch.randint(0, 128000, (batch, {PROMPT}), generator=torch.Generator().manual_seed(batch)).tolist()
    model.decoder = None
    decoder = decode_graphs.decoder_of(model)
    decoder.capture = False
    mnb.generate(model, ids, max_new_tokens=1, stream=False)
    def by_name(n):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            mnb.generate(model, ids, max_new_tokens=n, stream=False)
            torch.cuda.synchronize()
        names = {{}}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                count, us = names.get(e.name, (0, 0.0))
                names[e.name] = (count + 1, us + e.device_time)
        return names
    try:
        long, short = by_name(1 + steps), by_name(1)
        rows = []
        for name, (count, us) in long.items():
            c0, u0 = short.get(name, (0, 0.0))
            rows.append((round((us - u0) / steps, 2), round((count - c0) / steps, 2), name[:110]))
        rows.sort(reverse=True)
        return dict(side="kernel_table", batch=batch, kernel_us_per_token=round(sum(r[0] for r in rows), 1),
                    kernels_per_token=round(sum(r[1] for r in rows), 1), top=rows[:top])
    finally:
        model.decoder = None

def variant(name, batch, value=True):
    # timed() with decode_graphs.<name> set (a fresh decoder before and after); "default": no flag changed;
    # "<flag>=0": the flag set False (e.g. own_kernels=0: torch's ops and cuBLAS instead of mnb's kernels)
    label = name
    if "=" in name:
        name, value = name.split("=")[0], bool(int(name.split("=")[1]))
    if name == "default":
        model.decoder = None
        return dict(timed(batch), side="mnb-default")
    saved = getattr(decode_graphs, name)
    setattr(decode_graphs, name, value)
    model.decoder = None
    try:
        row = timed(batch)
        row["captured"] = all(g.captured for e in model.decoder.entries.values() for g in e.graphs.values())
        row["compiled"] = bool(model.decoder.compiled_blocks) and model.decoder.compile_failed is None
        row["own_kernels"] = model.decoder.kernels
        return dict(row, side="mnb-" + label)
    finally:
        setattr(decode_graphs, name, saved)
        model.decoder = None
"""

MNB_CHECK = """
def check():
    '''Graph path vs the per-token path on this GPU: a ragged fp32 batch, greedy and top_k=1 sampling,
    and the bf16 model's first tokens.'''
    import torch
    small = mnb.gpt("tiny", fusions=False)
    ragged = [[5, 17, 33, 2, 90, 41, 7], [300, 12], [64, 65, 66, 67]]
    fast = mnb.generate(small, ragged, max_new_tokens=40, stream=False)
    top1 = mnb.generate(small, ragged, max_new_tokens=40, temperature=1.5, top_k=1, seed=3, stream=False)
    buckets = sorted(small.decoder.entries)
    decode_graphs.sdpa_decode, small.decoder = True, None
    try:
        fast_sdpa = mnb.generate(small, ragged, max_new_tokens=40, stream=False)
    finally:
        decode_graphs.sdpa_decode, small.decoder = False, None
    decode_graphs.enabled = False
    try:
        slow = mnb.generate(small, ragged, max_new_tokens=40, stream=False)
        ids = torch.randint(0, 128000, (1, 128), generator=torch.Generator().manual_seed(1)).tolist()
        slow_big = mnb.generate(model, ids, max_new_tokens=16, stream=False)
    finally:
        decode_graphs.enabled = True
    fast_big = mnb.generate(model, ids, max_new_tokens=16, stream=False)
    same_big = next((i for i, (a, b) in enumerate(zip(fast_big[0], slow_big[0])) if a != b), 16)
    return dict(side="check", fp32_greedy_equal=fast == slow, fp32_top1_equal=top1 == slow,
                fp32_sdpa_greedy_equal=fast_sdpa == slow,
                bf16_first_equal_tokens=same_big, bf16_graph=fast_big[0], bf16_per_token=slow_big[0],
                graphs=buckets)
"""


BASELINE = """
def with_decoder(source, code):
    # ``code`` evaluated with ``source`` (another version of decode_graphs.py) in decode_graphs' place
    saved = dict(decode_graphs.__dict__)
    exec(compile(source, "baseline_decode_graphs.py", "exec"), decode_graphs.__dict__)
    model.decoder = None
    try:
        return eval(code)
    finally:
        model.decoder = None
        decode_graphs.__dict__.update(saved)
"""


def side_mnb(models: list[str], check: bool, baseline: str | None = None, variants: tuple[str, ...] = (),
             profile: bool = False) -> list[dict]:
    import traceback

    from mnb.controller import Pool

    rows = []

    def cell(code: str, **labels):
        try:
            return pool.run(code, quiet=True, timeout=600)[0]
        except Exception:  # noqa: BLE001 - the row says what failed; the next rows still run
            emit(rows, {"side": "mnb", **labels, "error": traceback.format_exc()[-3000:]})
            return None

    pool = Pool.start(1, gpus=[0], timeout=600)
    try:
        cell(MNB_TIMED + MNB_CHECK + BASELINE, step="define")
        extras = check or bool(baseline) or bool(variants) or profile  # on the first model, after the timed rows
        for index, model in enumerate(models):
            start = time.perf_counter()
            keep = "first = model\n" if extras and index == 1 else ""  # kept for the extras (memory only)
            if cell(f"{keep}model = None\nimport gc; gc.collect(); torch.cuda.empty_cache()\n"
                    f"model = mnb.gpt({model!r})\nfor chunk in model.chunks:\n    chunk.bfloat16()\n"
                    "pending = background_compile.pending()\n"
                    "pending.wait(600) if pending is not None else True", model=model, step="build") is None:
                continue
            build = time.perf_counter() - start
            for batch in BATCHES:
                row = cell(f"timed({batch})", model=model, batch=batch)
                if row is not None:
                    emit(rows, {**row, "model": model, "build_and_compile_s": round(build, 1)})
        model = models[0]
        if extras and len(models) > 1:
            cell("model, first = first, None", model=model, step="back to the first model")
        if check:  # greedy tokens as the per-token path's; kernels per token; the attention as one SDPA kernel
            row = cell("check()", model=model, step="check")
            if row is not None:
                emit(rows, {**row, "model": model})
            for batch in BATCHES:
                row = cell(f"kernels({batch})", model=model, batch=batch, step="kernels")
                if row is not None:
                    emit(rows, {**row, "model": model})
            for batch in BATCHES:
                row = cell(f"decode_graphs.sdpa_decode, model.decoder = True, None\n"
                           f"try:\n    row = dict(timed({batch}), kernels=kernels({batch})['per_token'])\n"
                           "finally:\n    decode_graphs.sdpa_decode, model.decoder = False, None\nrow",
                           model=model, batch=batch, step="sdpa")
                if row is not None:
                    emit(rows, {**row, "side": "mnb-sdpa", "model": model})
        for batch in BATCHES if profile else ():  # kernel time by name, on the first model
            row = cell(f"kernel_table({batch})", model=model, batch=batch, step="kernel_table")
            if row is not None:
                emit(rows, {**row, "model": model})
        for name in variants:  # the decode path with a flag of decode_graphs on, on the first model
            for batch in BATCHES:
                row = cell(f"variant({name!r}, {batch})", model=model, batch=batch, step=name)
                if row is not None:
                    emit(rows, {**row, "model": model})
        if baseline:
            for batch in BATCHES:
                code = f"dict(timed({batch}), kernels=kernels({batch})['per_token'])"
                row = cell(f"with_decoder({baseline!r}, {code!r})", model=model, batch=batch, step="baseline")
                if row is not None:
                    emit(rows, {**row, "side": "mnb-baseline", "model": model})
    finally:
        pool.stop()
    return rows


def side_hf(models: list[str], static: bool, folders: dict | None = None) -> list[dict]:
    """transformers' generate; ``folders`` (label -> Hugging Face folder) loads checkpoints instead of
    building random models of mnb's preset shapes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first put is the prompt
                value.cpu()
                self.first = time.perf_counter()

        def end(self):
            pass

    rows = []
    for model_name in models:
        if folders:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(folders[model_name], dtype=torch.bfloat16,
                                                         attn_implementation="sdpa").cuda().eval()
        else:
            s = shape(model_name)
            config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                                 num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                 num_key_value_heads=s["groups"], max_position_embeddings=131072,
                                 rope_theta=float(s["rope_base"]), tie_word_embeddings=s["tied"],
                                 attn_implementation="sdpa")
            torch.manual_seed(0)
            with torch.device("cuda"):
                model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        for batch in BATCHES:
            ids = torch.tensor(prompts(batch), device="cuda")
            mask = torch.ones_like(ids)
            extra = dict(cache_implementation="static") if static else {}

            def once(new):
                streamer = FirstToken()
                torch.cuda.synchronize()
                start = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                         min_new_tokens=new, pad_token_id=0, streamer=streamer, **extra)
                torch.cuda.synchronize()
                end = time.perf_counter()
                return end - start, streamer.first - start, (out.shape[1] - PROMPT) * batch, out[0, PROMPT:PROMPT + 8]

            first = once(NEW)[0]
            runs = [once(NEW) for _ in range(REPEATS)]
            total = statistics.median(r[0] for r in runs)
            emit(rows, dict(side="hf-static" if static else "hf-dynamic", model=model_name, batch=batch,
                            first_call_s=round(first, 3), ttft_s=round(statistics.median(r[1] for r in runs), 4),
                            total_s=round(total, 3), new_tokens=runs[0][2],
                            tokens_per_s=round(runs[0][2] / total, 1), first_ids=runs[0][3].tolist()))
        del model
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------- table
def table(rows: list[dict]) -> str:
    out = ["| model | batch | mnb tok/s | hf dynamic tok/s | hf static tok/s | floor tok/s | mnb / hf static "
           "| mnb / floor | TTFT mnb | TTFT hf dynamic | TTFT hf static | mnb first call (capture) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    get = {(r["side"], r.get("model"), r.get("batch")): r for r in rows}
    models = list(dict.fromkeys(r["model"] for r in rows if "batch" in r and "model" in r))
    for model in models:
        for batch in BATCHES:
            m, d, st, f = (get.get((side, model, batch), {}) for side in ("mnb", "hf-dynamic", "hf-static", "floor"))
            tps = lambda r: f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "–"  # noqa: E731
            ttft = lambda r: f"{r['ttft_s'] * 1e3:.1f} ms" if r.get("ttft_s") else "–"  # noqa: E731
            ratio = lambda a, b: f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}" if a.get("tokens_per_s") and b.get("tokens_per_s") else "–"  # noqa: E731,E501
            out.append(f"| {model} | {batch} | {tps(m)} | {tps(d)} | {tps(st)} | {tps(f)} | {ratio(m, st)} | "
                       f"{ratio(m, f)} | {ttft(m)} | {ttft(d)} | {ttft(st)} | "
                       f"{m.get('first_call_s', '–')} s |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu-out/generate.json")
    parser.add_argument("--models", default="llama-1b,llama-3b")
    parser.add_argument("--sides", default="floor,mnb,hf-dynamic,hf-static")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--batches", default="1,32", help="batch sizes, e.g. 32")
    parser.add_argument("--baseline-decoder", help="another version of mnb/megatron/decode_graphs.py to measure "
                        "beside this one (mnb side, first model)")
    parser.add_argument("--variants", default="", help="decode_graphs flags to measure on, one at a time, on the "
                        "first model (mnb side), e.g. compile_step,compile_attention")
    parser.add_argument("--profile", action="store_true", help="GPU time per decoded token by kernel name "
                        "(first model, the step uncaptured)")
    parser.add_argument("--side-timeouts", default="", help="seconds each side may run, e.g. mnb=190,hf-static=220")
    parser.add_argument("--hf-folders", help="JSON {label: Hugging Face folder}: transformers loads these "
                        "(bench/hf_gpu.py); the labels are the --models")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # internal: run one side in this process
    args = parser.parse_args()
    models = args.models.split(",")
    global BATCHES
    BATCHES = tuple(int(b) for b in args.batches.split(","))
    if args.side:
        import signal

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks (the pool's stop)
        global PART
        PART = Path(args.out)
        if args.side == "floor":
            side_floor(models)
        elif args.side == "mnb":
            side_mnb(models, args.check,
                     Path(args.baseline_decoder).read_text() if args.baseline_decoder else None,
                     tuple(v for v in args.variants.split(",") if v), args.profile)
        else:
            side_hf(models, static=args.side == "hf-static",
                    folders=json.loads(args.hf_folders) if args.hf_folders else None)
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch
    import transformers

    result: dict = {"prompt": PROMPT, "new": NEW, "repeats": REPEATS, "torch": torch.__version__,
                    "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "rows": []}
    try:
        import megatron.core

        result["megatron_core"] = megatron.core.__version__
    except Exception:  # noqa: BLE001 - the version is a label only
        pass
    limits = {k: float(v) for k, v in (item.split("=") for item in args.side_timeouts.split(",") if item)}
    for side in args.sides.split(","):  # one process per side, one after the other: the machine to itself
        part = out.with_suffix(f".{side}.jsonl")
        part.unlink(missing_ok=True)
        start = time.perf_counter()
        command = [sys.executable, __file__, "--side", side, "--models", args.models, "--out", str(part),
                   "--batches", args.batches]
        command += ["--check"] if args.check else []
        command += ["--baseline-decoder", args.baseline_decoder] if args.baseline_decoder else []
        command += ["--variants", args.variants] if args.variants else []
        command += ["--profile"] if args.profile else []
        proc = subprocess.Popen(command, env=dict(os.environ))
        try:
            code = proc.wait(timeout=limits.get(side))
        except subprocess.TimeoutExpired:  # the rows it finished are kept; SIGTERM lets it stop its pool
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            code = "timeout"
        rows = [json.loads(line) for line in part.read_text().splitlines()] if part.exists() else []
        result["rows"] += rows + ([{"side": side, "error": f"exit {code}"}] if code != 0 else [])
        result[f"{side}_wall_s"] = round(time.perf_counter() - start, 1)
        out.write_text(json.dumps(result, indent=1))
    result["table"] = table(result["rows"])
    out.write_text(json.dumps(result, indent=1))
    print(result["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
