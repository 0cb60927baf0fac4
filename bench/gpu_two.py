"""Issue 42 on two GPUs in one call: re-layout speed, MFU and memory of every strategy, context
parallelism, NCCL failures named, decode and LoRA under tp2.  One 2-rank pool (the Pool API: the
device machine has no IPython; ``%mnb`` / ``%%megatron`` call the same methods).

    # nvidia-h200-x2 (wheels in .whl/, as bench/gpu_session.sh installs them), about 9 minutes
    # (the pool's start, then 480 s of sections: --budget-s):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 bench/gpu_two.py --out $OUT
    # this script's logic on 2 CPU ranks (gloo, the tiny presets, short sequences, a few steps):
    PYTHONPATH=$PWD python3 bench/gpu_two.py --device cpu --out /tmp/gpu_two_cpu

Sections (``--sections``, default all, in this order; each guarded: a failure is a row with its
traceback and the next section runs; each has a time limit, ``--limits name=s,...``, and the whole
run a budget, ``--budget-s``: a case that would start past either is a ``skipped`` row):

relayout  The pool's first llama-1b model and step under tp1·dp2, then a layout change to tp2 and
          to pp2, each to its first finished step (one cell: re-layout + ``mnb.gpt`` + one step),
          against a cold ``torchrun`` of the same step (bench/plain_torchrun.py with Megatron's own
          ops, no compile).  Goal: the pool >= 15x faster.
mfu       llama-1b (mbs 8) and llama-3b (mbs 4), seq 2048, bf16, 3 steps: dp2 with the distributed
          optimizer (the reference), tp2 + sequence parallel, pp2 with m = 8 and 16, pp2·vpp2 (m = 8),
          and Megatron-FSDP with each strategy (optim, optim_grads, optim_grads_params); the layouts
          without a pipeline take m = 4 microbatches per dp rank (the budget; their gradient reduction
          is overlapped, so m hardly moves their MFU).  The fused kernels' background compile is waited
          for before the steps.  Goals: MFU >= 65 % of the measured 790 TFLOP/s bf16 peak per GPU;
          ``mnb.estimate``'s memory within +-5 % of the measured peak on every rank.
cp        llama-1b at seq 16k and 32k, cp2 against cp1 (dp2), the same global batch (2 sequences),
          bf16, 20 steps: tokens/s, memory per rank, losses.  Goal: loss parity <= 2 %.
failures  Under tp2 (NCCL): one rank raises inside a training step (the root cause shown, the time
          from the raise to the error, the next cell runs with no manual restart, time to recover);
          one rank skips an all-reduce: ``%mnb stacks`` (``Pool.stacks_report``) while it hangs and
          the report of a cell past its timeout must name the collective, its group, its sequence
          number and the rank behind, read from PyTorch's Flight Recorder.
generate  ``mnb.generate`` with the decode graphs, llama-1b bf16, prompt 128, 256 new tokens, greedy,
          batch 1 and 32, tp2 against tp1 (dp2: each rank decodes the whole batch): tokens/s (median
          of 3 calls after a first call that captures the graphs) and the tokens themselves.
lora      ``mnb.lora`` (rank 16, alpha 32, all linears) on llama-1b, seq 2048, bf16, under tp2 against
          tp1·dp2, the same global batch: tokens/s, memory per rank against the estimate, losses.

Measurements: step time and tokens/s are the **mean of the steps after the first** (warm-up);
MFU = Megatron's model FLOPs per step / mean step time / GPUs / 790e12 (CUDA only).  Memory: each
rank's measured peak (the CUDA allocator's; on CPU the counted tensors) beside
``mnb.last_run.predicted_memory`` (``mnb.estimate.memory``), the difference (predicted - measured) /
measured in percent.

``--device cpu`` runs the same code paths with ``tiny`` (and ``moe-tiny`` in place of llama-3b),
fp32, seq 64 (cp: 128 and 256), 2-3 steps, on gloo.  There the Flight Recorder does not exist (mnb
counts gloo's collectives itself: the rows say which source named the hang), the decode graphs run
as plain calls (``decode_graphs.cpu_standin``), ``fsdp='optim'`` is refused by mnb on CPU ranks
(a ``skipped`` row), and MFU and the goals are not judged.

Writes OUT/gpu_two.json (every row, by section) and OUT/gpu_two.md (a table per section) after
every row, so a call cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import platform
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_measure import MEASURED_PEAK_FLOPS, plain_torchrun, standby_ready  # noqa: E402
from mnb.config import FSDP_STRATEGIES, ParallelConfig, load_preset  # noqa: E402

SECTIONS = ("relayout", "mfu", "cp", "failures", "generate", "lora")
NPROC = 2


# ------------------------------------------------------------------------------ settings per device
@dataclass(frozen=True)
class Setup:
    """Everything that differs between the GPU run and its CPU stand-in."""

    device: str
    dense: str                      # llama-1b / tiny
    bigger: str                     # llama-3b / moe-tiny
    seq: int
    bf16: bool
    mbs: dict[str, int]             # MFU micro batch per model
    mfu_steps: int
    relayout_batch: tuple[int, int]  # (mbs, gbs) of the re-layout step
    cp_seqs: tuple[int, ...]
    cp_steps: int
    gen_prompt: int
    gen_new: int
    gen_batches: tuple[int, ...]
    gen_repeats: int
    lora: tuple[int, int, int]      # (mbs, gbs, steps)
    hang_timeout_s: float
    kernel_wait_s: float            # the fused kernels' background compile, waited for before timed steps
    budget_s: float
    limits: dict[str, float] = field(default_factory=dict)
    mem_unit: tuple[str, int] = ("GiB", 2**30)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


CUDA = Setup(device="cuda", dense="llama-1b", bigger="llama-3b", seq=2048, bf16=True,
             mbs={"llama-1b": 8, "llama-3b": 4}, mfu_steps=3, relayout_batch=(1, 2),
             cp_seqs=(16384, 32768), cp_steps=20, gen_prompt=128, gen_new=256, gen_batches=(1, 32),
             gen_repeats=3, lora=(4, 16, 5), hang_timeout_s=10.0, kernel_wait_s=120.0, budget_s=480.0,
             limits={"relayout": 70, "mfu": 165, "cp": 110, "failures": 55, "generate": 45, "lora": 35})
CPU = Setup(device="cpu", dense="tiny", bigger="moe-tiny", seq=64, bf16=False,
            mbs={"tiny": 1, "moe-tiny": 1}, mfu_steps=3, relayout_batch=(1, 2),
            cp_seqs=(128, 256), cp_steps=3, gen_prompt=16, gen_new=16, gen_batches=(1, 32),
            gen_repeats=2, lora=(2, 4, 3), hang_timeout_s=10.0, kernel_wait_s=5.0, budget_s=1380.0,
            limits={"relayout": 300, "mfu": 420, "cp": 150, "failures": 300, "generate": 150, "lora": 120},
            mem_unit=("MiB", 2**20))


# ------------------------------------------------------------------------------ rows and files
class Report:
    """Rows by section, printed as they come; OUT/gpu_two.json and .md rewritten after every row."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.meta, self.rows, self.walls = out, meta, {}, {}

    def add(self, section: str, row: dict) -> None:
        print(f"[{section}] {json.dumps(row, default=str)[:2000]}", flush=True)
        self.rows.setdefault(section, []).append(row)
        self.save()

    def section_wall(self, section: str, seconds: float) -> None:
        self.walls[section] = round(seconds, 1)
        self.save()

    def save(self) -> None:
        data = {"meta": self.meta, "section_wall_s": self.walls, "rows": self.rows}
        (self.out / "gpu_two.json").write_text(json.dumps(data, indent=1, default=str))
        (self.out / "gpu_two.md").write_text(markdown(self.meta, self.walls, self.rows))


LONG = 160
"""Values longer than this (as text) go below a section's table, not into it."""


def markdown(meta: dict, walls: dict, rows: dict) -> str:
    lines = ["# bench/gpu_two.py (issue 42)", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| section | wall s | rows | error rows | skipped |", "|---|---:|---:|---:|---:|"]
    for section, section_rows in rows.items():
        errors = sum(1 for r in section_rows if "error" in r)
        skipped = sum(1 for r in section_rows if "skipped" in r)
        lines.append(f"| {section} | {walls.get(section, '')} | {len(section_rows)} | {errors} | {skipped} |")
    for section, section_rows in rows.items():
        lines += ["", f"## {section}", ""] + table(section_rows)
    return "\n".join(lines) + "\n"


def table(rows: list[dict]) -> list[str]:
    """A markdown table of the short values; each long one (reports, tracebacks, losses) below it."""
    text = {id(r): {k: cell(v) for k, v in r.items()} for r in rows}
    keys = list(dict.fromkeys(k for r in rows for k, v in text[id(r)].items() if len(v) <= LONG))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(text[id(r)].get(k, "") if len(text[id(r)].get(k, "")) <= LONG else "(below)"
                                for k in keys) + " |" for r in rows]
    for number, r in enumerate(rows, 1):
        for k, v in text[id(r)].items():
            if len(v) > LONG:
                lines += ["", f"row {number} `{k}`:", "", "```", str(r[k]).strip(), "```"]
    return lines


def cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


# ------------------------------------------------------------------------------ the bench
class Bench:
    """The pool, the setup, the report and the clock every section uses."""

    def __init__(self, setup: Setup, report: Report, pool):
        self.setup, self.report, self.pool = setup, report, pool
        self.started = time.monotonic()
        self.section_end = float("inf")

    # -- time
    def budget_left(self) -> float:
        return self.setup.budget_s - (time.monotonic() - self.started)

    def begin_section(self, name: str) -> None:
        self.section_end = time.monotonic() + min(self.setup.limits.get(name, 600.0), self.budget_left())

    def left(self) -> float:
        return self.section_end - time.monotonic()

    def skip_if_late(self, section: str, case: dict) -> bool:
        """A ``skipped`` row for ``case`` when the section's limit (or the run's budget) has passed."""
        if self.left() > 0:
            return False
        self.report.add(section, {**case, "skipped": "section time limit or run budget reached"})
        return True

    def cell_timeout(self) -> float:
        """A cell may run to the section's end, with 30 s of slack, and never less than 60 s."""
        return max(60.0, self.left() + 30.0)

    # -- the pool
    def run(self, code: str, layout: ParallelConfig | None = None, timeout: float | None = None) -> dict:
        return self.pool.run(code, layout=layout, quiet=True, timeout=timeout or self.cell_timeout())

    def trained(self, code: str, layout: ParallelConfig):
        """Run a cell that trains; its run (``mnb.last_run``), or RuntimeError when it recorded none."""
        from mnb.controller import last_run

        before = last_run()
        self.run(code, layout)
        run = last_run()
        if run is None or run is before:
            raise RuntimeError("the cell finished without a training record")
        return run

    def reset(self) -> None:
        """The default layout on running ranks (restarted when the last section left them broken)."""
        try:
            self.pool.run(FRESH, layout=ParallelConfig(), quiet=True, timeout=180)
        except Exception:  # noqa: BLE001 - whatever a failed section left: the same pool again
            self.pool.restart(layout=ParallelConfig())
            self.pool.run("pass", quiet=True, timeout=600)

    # -- shared pieces of cells
    def model_code(self, preset: str, seq: int) -> str:
        """``model = mnb.gpt(...)`` (any earlier model freed first), with room for ``seq`` positions."""
        kw = f", seq_length={seq}"
        if seq > load_preset(preset).max_position_embeddings:
            kw += f", max_position_embeddings={seq}"
        return f"{FRESH}model = mnb.gpt({preset!r}{kw})\n"

    def wait_for_kernels(self) -> str:
        return WAIT_FOR_KERNELS.format(seconds=self.setup.kernel_wait_s) if self.setup.kernel_wait_s else ""

    def train_code(self, steps: int, mbs: int, gbs: int, extra: str = "") -> str:
        return (f"mnb.train(model, steps={steps}, micro_batch_size={mbs}, global_batch_size={gbs}, "
                f"bf16={self.setup.bf16}{extra})\n")


FRESH = "model = None\nimport gc; gc.collect()\nif torch.cuda.is_available(): torch.cuda.empty_cache()\n"
WAIT_FOR_KERNELS = ("from mnb.megatron import background_compile\n_pending = background_compile.pending()\n"
                    "_pending.wait({seconds}) if _pending is not None else True\n")


# ------------------------------------------------------------------------------ one run as a row
def run_row(run, unit: tuple[str, int]) -> dict:
    """Throughput (mean of the steps after the first), MFU on CUDA, each rank's memory against the estimate."""
    steady = run.steady_steps(run.steps)
    times = [t for s, t in zip(run.steps, run.step_times_s) if s in steady and t]
    tokens = [x for s, x in zip(run.steps, run.tokens_per_s) if s in steady and x]
    step_s = statistics.mean(times) if times else None
    row = {"layout": run.layout.describe(), "m": run.num_microbatches, "timed": run.steps_note(steady, "mean"),
           "step_s": round(step_s, 4) if step_s else None,
           "tokens_per_s": round(statistics.mean(tokens)) if tokens else None}
    if not run.on_cpu and step_s:
        row["mfu_vs_790"] = round(run.model_flops_per_step / step_s / run.world_size / MEASURED_PEAK_FLOPS, 4)
    row.update(memory_columns(run, unit))
    row["unfused_steps"] = run.unfused_steps or None
    row["losses"] = [round(x, 4) if x is not None else None for x in run.losses]
    return row


def memory_columns(run, unit: tuple[str, int]) -> dict:
    """``r<rank>_<unit>`` measured, ``r<rank>_pred_<unit>`` predicted and ``r<rank>_err_%`` for every rank."""
    name, size = unit
    peaks = run.peak_memory_bytes
    columns, worst = {"memory_source": run.memory_source}, 0.0
    try:
        predicted = run.predicted_memory
    except Exception as exc:  # noqa: BLE001 - a layout the estimate refuses: the row says why
        return {**columns, **{f"r{r}_{name}": round(b / size, 3) for r, b in sorted(peaks.items())},
                "estimate_error": f"{type(exc).__name__}: {exc}"[:300]}
    for rank, measured in sorted(peaks.items()):
        pred = predicted.for_rank(rank).total_bytes
        err = 100.0 * (pred - measured) / measured
        worst = max(worst, abs(err))
        columns.update({f"r{rank}_{name}": round(measured / size, 3), f"r{rank}_pred_{name}": round(pred / size, 3),
                        f"r{rank}_err_%": round(err, 1)})
    columns["worst_err_%"] = round(worst, 1)
    return columns


def judged(setup: Setup, ok: bool, goal: str) -> str:
    return f"{goal}: {'met' if ok else 'missed'}" if setup.cuda else f"{goal}: not judged on CPU"


def error_row(case: dict) -> dict:
    return {**case, "error": traceback.format_exc()[-3000:]}


# ------------------------------------------------------------------------------ 1. relayout
RELAYOUT_CELL = """import time
_t0 = time.perf_counter()
{model}_t1 = time.perf_counter()
{train}parts = (round(_t1 - _t0, 3), round(time.perf_counter() - _t1, 3))
"""


def section_relayout(bench: Bench) -> None:
    """tp1·dp2 (the pool's first model) -> tp2 -> pp2, each to its first step; then cold torchruns."""
    s = bench.setup
    mbs, gbs = s.relayout_batch
    cell_code = RELAYOUT_CELL.format(model=bench.model_code(s.dense, s.seq), train=bench.train_code(1, mbs, gbs))
    pool_s = {}
    for label, layout in (("tp1·dp2, the pool's first model", ParallelConfig()),
                          ("layout change tp1·dp2 -> tp2", ParallelConfig(tp=2)),
                          ("layout change tp2 -> pp2", ParallelConfig(pp=2))):
        case = {"case": f"pool: {label} -> first finished step"}
        if bench.skip_if_late("relayout", case):
            continue
        began = time.perf_counter()
        run = bench.trained(cell_code, layout)
        total = time.perf_counter() - began
        gpt_s, step_s = bench.pool.pull("parts")[0]
        pool_s[layout.resolve(NPROC).describe()] = total
        bench.report.add("relayout", {**case, "to_first_step_s": round(total, 3), "gpt_s": gpt_s,
                                      "first_step_s": step_s, "relayout_and_rest_s": round(total - gpt_s - step_s, 3),
                                      "unfused_steps": run.unfused_steps or None})
    bench.run(FRESH)  # the pool's models freed before the cold launches share the devices
    for flag, layout in (("tp=2", ParallelConfig(tp=2)), ("pp=2", ParallelConfig(pp=2))):
        case = {"case": f"cold torchrun ({flag}, Megatron's own ops) -> first finished step"}
        if bench.skip_if_late("relayout", case):
            continue
        cold = plain_torchrun(bench.report.out, nproc=NPROC, layout=flag, steps=1, mbs=mbs, gbs=gbs, preset=s.dense,
                              seq=s.seq, device=s.device, bf16=s.bf16, extra=("--no-fusions",))
        warm = pool_s.get(layout.resolve(NPROC).describe())
        row = {**case, "cold_s": cold.get("first_step_s"), "pool_s": round(warm, 3) if warm else None}
        if cold.get("error"):
            row["error"] = f"cold torchrun failed: {cold['error']} (its output is printed above)"
        elif warm:
            row["speedup"] = round(cold["first_step_s"] / warm, 1)
            row["goal"] = judged(s, row["speedup"] >= 15, ">= 15x")
        bench.report.add("relayout", row)


# ------------------------------------------------------------------------------ 2. mfu
def mfu_cases() -> list[tuple[str, ParallelConfig, int, str]]:
    """(label, layout, microbatches per dp rank, extra train arguments) of every strategy."""
    cases = [("dp2 + distributed optimizer (reference)", ParallelConfig(), 4, ", use_distributed_optimizer=True"),
             ("tp2 + sp", ParallelConfig(tp=2, sequence_parallel=True), 4, ""),
             ("pp2 m=8", ParallelConfig(pp=2), 8, ""),
             ("pp2 m=16", ParallelConfig(pp=2), 16, ""),
             ("pp2 vpp2 m=8", ParallelConfig(pp=2, vpp=2), 8, "")]
    cases += [(f"fsdp {strategy}", ParallelConfig(fsdp=strategy), 4, "") for strategy in FSDP_STRATEGIES]
    return cases


FSDP_OPTIM_SKIPPED = ("refused by mnb on CPU ranks (mnb.config.FSDP_OPTIM_ON_CPU: its gradients are not DDP's "
                      "on gloo); runs on GPUs")


def section_mfu(bench: Bench) -> None:
    s = bench.setup
    for preset in (s.dense, s.bigger):
        reference = None
        for label, layout, m, extra in mfu_cases():
            case = {"model": preset, "case": label}
            if bench.skip_if_late("mfu", case):
                continue
            if not s.cuda and layout.fsdp == "optim":
                bench.report.add("mfu", {**case, "skipped": FSDP_OPTIM_SKIPPED})
                continue
            mbs = s.mbs[preset]
            gbs = mbs * m * layout.resolve(NPROC).dp
            try:
                run = bench.trained(bench.model_code(preset, s.seq) + bench.wait_for_kernels()
                                    + bench.train_code(s.mfu_steps, mbs, gbs, extra), layout)
                row = {**case, "mbs": mbs, "gbs": gbs, **run_row(run, s.mem_unit)}
            except Exception:  # noqa: BLE001 - a case that fails is a row; the next still runs
                bench.report.add("mfu", error_row(case))
                continue
            reference = reference or (row["tokens_per_s"] if "reference" in label else None)
            if reference and row["tokens_per_s"]:
                row["vs_reference"] = round(row["tokens_per_s"] / reference, 3)
            if s.cuda:
                row["goal"] = "; ".join([judged(s, (row.get("mfu_vs_790") or 0) >= 0.65, "MFU >= 65 %"),
                                         judged(s, row.get("worst_err_%", 99) <= 5, "memory within 5 %")])
            bench.report.add("mfu", row)
    bench.run(FRESH)


# ------------------------------------------------------------------------------ 3. cp
def section_cp(bench: Bench) -> None:
    """cp1 (dp2) and cp2 (dp1) on the same global batch of 2 sequences: throughput, memory, losses."""
    s = bench.setup
    for seq in s.cp_seqs:
        losses = {}
        for layout in (ParallelConfig(), ParallelConfig(cp=2)):
            case = {"seq": seq, "case": f"cp{layout.cp}"}
            if bench.skip_if_late("cp", case):
                continue
            try:
                run = bench.trained(bench.model_code(s.dense, seq) + bench.wait_for_kernels()
                                    + bench.train_code(s.cp_steps, 1, 2), layout)
            except Exception:  # noqa: BLE001
                bench.report.add("cp", error_row(case))
                continue
            losses[layout.cp] = run.losses  # unrounded: the parity is computed from these
            bench.report.add("cp", {**case, **run_row(run, s.mem_unit)})
        if len(losses) == 2:
            bench.report.add("cp", loss_parity(s, seq, losses[1], losses[2]))
    bench.run(FRESH)


def loss_parity(setup: Setup, seq: int, reference: list, other: list) -> dict:
    diffs = [abs(b - a) / abs(a) for a, b in zip(reference, other) if a and b is not None]
    worst = 100 * max(diffs) if diffs else None
    last = 100 * diffs[-1] if diffs else None
    return {"seq": seq, "case": "loss parity cp2 vs cp1", "worst_step_diff_%": round(worst, 4) if diffs else None,
            "last_step_diff_%": round(last, 4) if diffs else None,
            "goal": judged(setup, worst is not None and worst <= 2, "<= 2 %")}


# ------------------------------------------------------------------------------ 4. failures
RAISE_IN_STEP = """import time
def _raise_on_rank1(*_):
    _raise_on_rank1.calls += 1
    if rank == 1 and _raise_on_rank1.calls == 3:  # step 2's first forward on rank 1
        open({stamp!r}, 'w').write(repr(time.time()))
        raise ValueError('root cause: rank 1 raised inside a tp2 training step')
_raise_on_rank1.calls = 0
_hook = model.chunks[0].register_forward_pre_hook(_raise_on_rank1)
try:
    {train}finally:
    _hook.remove()
"""

SKIP_ALL_REDUCE = """import os, time
g = ps.get_tensor_model_parallel_group()
x = torch.ones(4, device=device)
for i in range(5):
    if rank == 1 and i == 2:
        continue                      # rank 1 skips one all-reduce
    dist.all_reduce(x, group=g)
if device.type == 'cuda':
    x.sum().item()                    # NCCL returns at once: rank 0 waits here for its 5th
try:
    while rank == 1 and not os.path.exists({release!r}):
        time.sleep(0.01)
finally:
    if rank == 1:
        dist.all_reduce(x, group=g)   # the skipped one: rank 0 is released
        if device.type == 'cuda':
            torch.cuda.synchronize()
"""

SKIPPED_LINE = re.compile(r"rank (?P<behind>\d+) is at (?P<op>\w+) #(?P<low>\d+) of (?P<group>.+? group \[[\d,]+\]); "
                          r"rank \d+ is at #(?P<high>\d+) — rank \d+ skipped one")
"""The diagnosis line of a skipped collective (mnb/controller/hangs.py), e.g. ``rank 1 is at all_reduce #4 of
tp group [0,1]; rank 0 is at #5 — rank 1 skipped one (or rank 0 ran one more)``."""


def section_failures(bench: Bench) -> None:
    tp2 = ParallelConfig(tp=2)
    for check in (raise_in_training_step, hang_named_by_stacks, hang_named_by_timeout):
        case = {"case": check.__name__.replace("_", " ")}
        if bench.skip_if_late("failures", case):
            continue
        try:
            bench.report.add("failures", {**case, **check(bench, tp2)})
        except Exception:  # noqa: BLE001
            bench.report.add("failures", error_row(case))
            bench.reset()


def raise_in_training_step(bench: Bench, tp2: ParallelConfig) -> dict:
    """Rank 1 raises in step 2's forward while rank 0 waits in a tp collective; the next cells, no restart typed."""
    s = bench.setup
    mbs, gbs = s.relayout_batch
    bench.run(bench.model_code(s.dense, s.seq) + bench.train_code(1, mbs, gbs), tp2)
    standby_ready(bench.pool, timeout_s=120)  # a standby (CUDA pools) launched by now, as in a session
    restarts = bench.pool.restarts
    stamp = Path(tempfile.mkdtemp(prefix="mnb-raise-")) / "raised_at"
    code = RAISE_IN_STEP.format(stamp=str(stamp), train=bench.train_code(3, mbs, gbs))
    began = time.perf_counter()
    with StampedStderr("failed first") as shown:
        try:
            bench.run(code, tp2, timeout=300)
            return {"error": "the cell did not fail"}
        except Exception as exc:  # noqa: BLE001 - what the notebook shows is the measurement
            ended_at, failure = time.time(), exc
    failed_s = time.perf_counter() - began
    raised_at = float(stamp.read_text()) if stamp.exists() else None
    began = time.perf_counter()
    ranks = bench.run("rank", timeout=600)
    recover_s = time.perf_counter() - began
    began = time.perf_counter()
    bench.run(bench.model_code(s.dense, s.seq) + bench.train_code(1, mbs, gbs))
    train_again_s = time.perf_counter() - began
    return {"error_type": type(failure).__name__, "root_cause_shown": root_cause_first(failure),
            "raise_to_root_cause_shown_s": round(shown.at - raised_at, 2) if raised_at and shown.at else None,
            "raise_to_cell_error_s": round(ended_at - raised_at, 2) if raised_at else None,
            "cell_s": round(failed_s, 2), "restarted_by_pool": bench.pool.restarts - restarts,
            "next_cell_ok": ranks == {0: 0, 1: 1}, "recover_s": round(recover_s, 2),
            "train_again_s": round(train_again_s, 2), "start_note": bench.pool.start_note,
            "message": rendered(failure)[:2500]}


class StampedStderr:
    """``sys.stderr`` for a while, passed through; ``at``: when ``marker`` was first written (the pool
    prints a rank's traceback there as soon as it fails first, while the others still run)."""

    def __init__(self, marker: str):
        self.marker, self.at, self.stream = marker, None, sys.stderr

    def __enter__(self) -> "StampedStderr":
        sys.stderr = self
        return self

    def __exit__(self, *exc) -> None:
        sys.stderr = self.stream

    def write(self, text: str) -> int:
        if self.at is None and self.marker in text:
            self.at = time.time()
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def root_cause_first(failure: Exception) -> bool:
    """The error names rank 1's ValueError as the first failure (the root cause), not rank 0's wait."""
    from mnb.errors import CompositeRankError

    cause = getattr(failure, "root_cause", None)
    return (isinstance(failure, CompositeRankError) and cause is not None and cause.rank == 1
            and cause.ename == "ValueError" and "root cause" in cause.evalue
            and "(first failure)" in rendered(failure))


def rendered(failure: Exception) -> str:
    """What the notebook shows for ``failure`` (IPython's ``_render_traceback_``), colours removed."""
    render = getattr(failure, "_render_traceback_", None)
    text = "\n".join(render()) if render else f"{type(failure).__name__}: {failure}"
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def hang_named_by_stacks(bench: Bench, tp2: ParallelConfig) -> dict:
    """While rank 0 waits for the all-reduce rank 1 skipped: what ``%mnb stacks`` says, and from which source."""
    release = Path(tempfile.mkdtemp(prefix="mnb-hang-")) / "release"
    outcome: list = []
    bench.run("pass", tp2)
    restarts = bench.pool.restarts
    cell = threading.Thread(target=lambda: outcome.append(bench.run(SKIP_ALL_REDUCE.format(release=str(release)),
                                                                    tp2, timeout=180)))
    began = time.monotonic()
    cell.start()
    report, named = "", None
    while named is None and cell.is_alive() and time.monotonic() - began < 90:
        time.sleep(0.2)
        report = str(bench.pool.stacks_report())
        named = SKIPPED_LINE.search(report)
    named_s = time.monotonic() - began
    sources = collective_sources(bench.pool)
    release.touch()
    cell.join(180)
    return {**hang_fields(named, report, sources), "seconds_to_name": round(named_s, 2),
            "cell_finished_after_release": bool(outcome), "restarted_by_pool": bench.pool.restarts - restarts,
            "report": report[-3000:]}


def hang_named_by_timeout(bench: Bench, tp2: ParallelConfig) -> dict:
    """The same hang past the cell's timeout: the report that ends the cell; rank 1's ``finally`` releases rank 0."""
    from mnb.errors import CellTimeoutError

    restarts = bench.pool.restarts
    never = Path(tempfile.mkdtemp(prefix="mnb-hang-")) / "never"
    began = time.perf_counter()
    try:
        bench.run(SKIP_ALL_REDUCE.format(release=str(never)), tp2, timeout=bench.setup.hang_timeout_s)
        return {"error": "the cell did not time out"}
    except CellTimeoutError as exc:
        text = str(exc)
    cell_s = time.perf_counter() - began
    named = SKIPPED_LINE.search(text)
    next_ok = bench.run("rank", timeout=600) == {0: 0, 1: 1}
    return {**hang_fields(named, text, None), "timeout_s": bench.setup.hang_timeout_s, "cell_s": round(cell_s, 2),
            "restarted_by_pool": bench.pool.restarts - restarts, "next_cell_ok": next_ok, "report": text[-3000:]}


def hang_fields(named, text: str, sources: dict | None) -> dict:
    """Whether the report names the collective, its group, its sequence numbers and the rank behind."""
    fields = {"named": bool(named), "collective": named["op"] if named else None,
              "group": named["group"] if named else None,
              "seq_behind_ahead": f"#{named['low']} / #{named['high']}" if named else None,
              "missing_rank": int(named["behind"]) if named else None,
              "waiting_line": next((line.strip() for line in text.splitlines() if " in all_reduce #" in line), None)}
    if sources is not None:
        fields["source"] = ", ".join(f"r{r}: {src}" for r, src in sorted(sources.items()))
        fields["flight_recorder"] = bool(sources) and all(src == "flight recorder" for src in sources.values())
        if "flight recorder" not in sources.values():
            fields["note"] = "gloo ranks: mnb counts the collectives itself; the Flight Recorder needs NCCL"
    return fields


def collective_sources(pool) -> dict[int, str]:
    """Which source each rank's collective read-out came from ('flight recorder' on NCCL, 'mnb' on gloo):
    ``Pool.collectives``, what ``%mnb stacks`` reads."""
    return {r: (read_out or {}).get("source", "none") for r, read_out in pool.collectives().items()}


# ------------------------------------------------------------------------------ 5a. generate
GENERATE_DEFS = """import statistics, time
from mnb.megatron import decode_graphs
decode_graphs.cpu_standin = {standin}

def _sync():
    if device.type == 'cuda':
        torch.cuda.synchronize()

def timed_generate(batch, prompt, new, repeats):
    vocab = min(model.config.vocab_size, 128000)
    ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(batch)).tolist()
    def once():
        _sync()
        t0 = time.perf_counter()
        out = mnb.generate(model, ids, max_new_tokens=new, stream=False)
        _sync()
        return time.perf_counter() - t0, out
    first_s, _ = once()  # captures this bucket's graphs
    runs = [once() for _ in range(repeats)]
    median_s = statistics.median(t for t, _ in runs)
    out = runs[0][1]
    tokens = sum(len(o) for o in out)
    d = model.decoder
    return dict(first_call_s=round(first_s, 3), median_s=round(median_s, 4), new_tokens=tokens,
                tokens_per_s=round(tokens / median_s, 1), graph_path=d is not None,
                buckets=sorted(d.entries) if d is not None else None,
                capture_notes=list(getattr(d, 'capture_notes', None) or []) or None, tokens_row0=out[0])
"""


def section_generate(bench: Bench) -> None:
    s = bench.setup
    defs = GENERATE_DEFS.format(standin=not s.cuda)
    to_bf16 = "for _chunk in model.chunks:\n    _chunk.bfloat16()\n" if s.bf16 else ""
    tp1: dict[int, tuple[dict, list]] = {}  # batch -> (row, tokens of row 0) under tp1
    try:
        for layout in (ParallelConfig(), ParallelConfig(tp=2)):
            built = False
            for batch in s.gen_batches:
                case = {"layout": layout.resolve(NPROC).describe(), "batch": batch}
                if bench.skip_if_late("generate", case):
                    continue
                try:
                    if not built:
                        bench.run(defs + bench.model_code(s.dense, s.seq) + to_bf16 + bench.wait_for_kernels(), layout)
                        built = True
                    row = bench.run(f"timed_generate({batch}, {s.gen_prompt}, {s.gen_new}, {s.gen_repeats})",
                                    layout)[0]
                except Exception:  # noqa: BLE001
                    bench.report.add("generate", error_row(case))
                    continue
                ids = row.pop("tokens_row0")
                row = {**case, **row}
                if layout.tp == 1:
                    tp1[batch] = (row, ids)
                elif batch in tp1:
                    row.update(versus_tp1(tp1[batch], (row, ids)))
                bench.report.add("generate", row)
    finally:
        bench.run(FRESH + "from mnb.megatron import decode_graphs\ndecode_graphs.cpu_standin = False\n")


def versus_tp1(tp1: tuple[dict, list], tp2: tuple[dict, list]) -> dict:
    """tp2 against tp1 at one batch: the tokens/s ratio and how many leading tokens of row 0 agree."""
    (tp1_row, tp1_ids), (tp2_row, tp2_ids) = tp1, tp2
    same = next((i for i, (a, b) in enumerate(zip(tp1_ids, tp2_ids)) if a != b), min(len(tp1_ids), len(tp2_ids)))
    return {"vs_tp1_tokens_per_s": round(tp2_row["tokens_per_s"] / tp1_row["tokens_per_s"], 3),
            "same_leading_tokens_as_tp1": f"{same}/{len(tp1_ids)}"}


# ------------------------------------------------------------------------------ 5b. lora
LORA_CODE = ("summary = mnb.lora(model, rank=16, alpha=32, targets='all-linear')\n"
             "trainable = summary.trainable\n")


def section_lora(bench: Bench) -> None:
    s = bench.setup
    mbs, gbs, steps = s.lora
    reference = None
    for layout in (ParallelConfig(), ParallelConfig(tp=2)):
        case = {"layout": layout.resolve(NPROC).describe(), "case": "mnb.lora r16 all-linear"}
        if bench.skip_if_late("lora", case):
            continue
        try:
            run = bench.trained(bench.model_code(s.dense, s.seq) + LORA_CODE + bench.wait_for_kernels()
                                + bench.train_code(steps, mbs, gbs, ", lr=1e-4"), layout)
            row = {**case, "trainable": bench.pool.pull("trainable")[0], "mbs": mbs, "gbs": gbs,
                   **run_row(run, s.mem_unit)}
        except Exception:  # noqa: BLE001
            bench.report.add("lora", error_row(case))
            continue
        if reference is None:
            reference = row
        else:
            row["vs_tp1_tokens_per_s"] = round(row["tokens_per_s"] / reference["tokens_per_s"], 3)
            row["loss_diff_vs_tp1_%"] = round(100 * max(abs(a - b) / abs(a) for a, b in
                                                        zip(reference["losses"], row["losses"])), 4)
        bench.report.add("lora", row)
    bench.run(FRESH)


# ------------------------------------------------------------------------------ the run
SECTION_FUNCTIONS = {"relayout": section_relayout, "mfu": section_mfu, "cp": section_cp,
                     "failures": section_failures, "generate": section_generate, "lora": section_lora}

RANK_FACTS = """import platform, sys, megatron.core
def _cpu_name():
    for line in open('/proc/cpuinfo'):
        if line.startswith('model name'):
            return line.split(':', 1)[1].strip()
    return platform.machine()
(str(torch.__version__), megatron.core.__version__, sys.version.split()[0],
 torch.cuda.get_device_name(device) if device.type == 'cuda' else _cpu_name())
"""


def run_sections(bench: Bench, names: list[str]) -> None:
    """Each section in order, guarded: a failure is a row with its traceback, then the pool is reset."""
    for name in names:
        began = time.perf_counter()
        bench.begin_section(name)
        if bench.budget_left() <= 0:
            bench.report.add(name, {"skipped": "run budget spent"})
        else:
            try:
                SECTION_FUNCTIONS[name](bench)
            except Exception:  # noqa: BLE001 - the next section still runs
                bench.report.add(name, error_row({"case": "section"}))
            try:
                bench.reset()
            except Exception:  # noqa: BLE001
                bench.report.add(name, error_row({"case": "reset after the section"}))
        bench.report.section_wall(name, time.perf_counter() - began)
        print(f"== {name}: {time.perf_counter() - began:.1f} s", flush=True)


def meta_of(setup: Setup, pool, start_s: float) -> dict:
    facts = pool.run(RANK_FACTS, quiet=True, timeout=300)
    torch_v, mcore_v, python_v, _ = facts[0]

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
            "device": setup.device, "devices": {r: f[3] for r, f in sorted(facts.items())},
            "torch": torch_v, "megatron_core": mcore_v, "python": python_v, "transformers": version("transformers"),
            "pool_start_s": round(start_s, 2), "pool": repr(pool),
            "statistic": "step time and tokens/s: mean of the steps after the first; MFU per GPU vs 790e12 (CUDA)",
            "command": "python3 " + " ".join(sys.argv)}


def parse_limits(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (item.split("=") for item in text.split(",") if item)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-two-out"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--budget-s", type=float, default=None, help="the whole run's seconds (default per device)")
    parser.add_argument("--limits", default="", help="seconds per section, e.g. mfu=200,cp=90")
    args = parser.parse_args()
    names = [n for n in args.sections.split(",") if n]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    base = CUDA if args.device == "cuda" else CPU
    setup = replace(base, limits={**base.limits, **parse_limits(args.limits)}, budget_s=args.budget_s or base.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a device time limit: the finally stops the pool
    from mnb.controller import Pool

    began = time.perf_counter()
    pool = Pool.start(NPROC, device=setup.device, gpus=[0, 1] if setup.cuda else None, timeout=600)
    try:
        report = Report(out, meta_of(setup, pool, time.perf_counter() - began))
        report.save()
        run_sections(Bench(setup, report, pool), names)
    finally:
        pool.stop()
    print((out / "gpu_two.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
