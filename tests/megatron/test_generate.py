"""mnb.generate and mnb.evaluate on a live 2-rank CPU pool (fp32, gloo, real Megatron-Core).

    PYTHONPATH=$PWD python -m pytest -q tests/megatron/test_generate.py

Greedy continuations of a batch of prompts of different lengths equal a no-cache reference
(a whole-sequence forward per token) under dp2, tp2, tp2+sp, pp2 and pp2+vpp2, and after a
live re-layout of a trained model (save under tp2, load under pp2); sampling repeats by seed;
stop strings; an interrupt stops every rank at the same token; a cell that runs an asyncio
loop; evaluation equals the loss ``mnb.logits`` implies and is recorded by ``eval_every``, also
for a Hugging Face checkpoint whose BPE tokenizer reads the text (under dp2 and tp2);
greedy continuations of tiny random Hugging Face checkpoints (Llama, Qwen2, GPT-2, Mixtral)
equal transformers' ``generate(do_sample=False)`` under dp2, tp2, pp2 and (Mixtral) ep2 and tp2+sp.
The GPU ranks' static-cache path (:mod:`mnb.megatron.decode_graphs`), run here with its graphs replaced
by plain calls, equals the reference under dp2, tp2, pp2, pp2+vpp2 and (MoE) ep2, and keeps its buckets.
Both CI legs (megatron-core 0.16 and 0.19).
"""

from __future__ import annotations

import _thread

import pytest

import mnb
from mnb.config import ParallelConfig

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [300, 12], [64, 65, 66, 67]]

REFERENCE = """
def reference(model, prompts, new):
    '''Greedy continuations, one whole-sequence mnb.logits per token (no KV cache).'''
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(new):
            ids.append(int(mnb.logits(model, [ids])[0, -1].argmax()))
        out.append(ids[len(prompt):])
    return out
"""


def same_on_every_rank(values: dict):
    first = values[0]
    assert all(v == first for v in values.values()), values
    return first


def test_greedy_equals_the_no_cache_reference_under_every_layout(cpu_pool):
    cpu_pool.run(REFERENCE, quiet=True)
    code = f"model = mnb.gpt('tiny')\nmnb.generate(model, {PROMPTS}, max_new_tokens=32, stream=False)"
    cpu_pool.run("model = mnb.gpt('tiny')\nref = reference(model, " + repr(PROMPTS) + ", 32)", quiet=True)
    reference = same_on_every_rank(cpu_pool.pull("ref"))
    assert [len(r) for r in reference] == [32, 32, 32]
    for layout in (ParallelConfig(), ParallelConfig(tp=2), ParallelConfig(tp=2, sequence_parallel=True),
                   ParallelConfig(pp=2), ParallelConfig(pp=2, vpp=2)):
        got = same_on_every_rank(cpu_pool.run(code, layout=layout, quiet=True))
        assert got == reference, layout
    # One prompt of ints answers with one list; a reference under pp2 agrees too.
    one = cpu_pool.run(f"mnb.generate(model, {PROMPTS[1]}, max_new_tokens=32, stream=False)", quiet=True)
    assert same_on_every_rank(one) == reference[1]
    cpu_pool.run("ref_pp = reference(model, " + repr(PROMPTS[:1]) + ", 8)", quiet=True)
    assert same_on_every_rank(cpu_pool.pull("ref_pp")) == [reference[0][:8]]


STANDIN = "from mnb.megatron import decode_graphs\ndecode_graphs.cpu_standin = {on}\n"


def test_the_static_cache_decode_equals_the_reference_and_keeps_its_buckets(cpu_pool):
    """The GPU path (static cache, one step per token, GPU-side sampling) run on the CPU ranks with
    the graph replaced by a plain call: the same tokens as the reference under dp2, tp2, pp2 and
    pp2+vpp2; its buckets reused across calls; released by a layout change and by ``del model``."""
    cpu_pool.run(REFERENCE, quiet=True)
    cpu_pool.run("model = mnb.gpt('tiny')\nref = reference(model, " + repr(PROMPTS) + ", 20)", quiet=True)
    reference = same_on_every_rank(cpu_pool.pull("ref"))
    code = f"mnb.generate(model, {PROMPTS}, max_new_tokens=20, stream=False)"
    try:
        for layout in (ParallelConfig(), ParallelConfig(tp=2), ParallelConfig(pp=2), ParallelConfig(pp=2, vpp=2)):
            got = cpu_pool.run(STANDIN.format(on=True) + "model = mnb.gpt('tiny')\n" + code,
                               layout=layout, quiet=True)
            assert same_on_every_rank(got) == reference, layout
        # The decode attention as one scaled_dot_product_attention (off by default): the same tokens (pp2+vpp2).
        sdpa = cpu_pool.run("decode_graphs.sdpa_decode, model.decoder = True, None\ntry:\n    got = " + code +
                            "\nfinally:\n    decode_graphs.sdpa_decode = False\n(got, model.decoder.state.sdpa)",
                            quiet=True)
        assert same_on_every_rank(sdpa) == (reference, True)
        # compile=True: each chunk's layers through torch.compile (Dynamo's tracing of Megatron's block; the
        # "eager" backend, no C++ toolchain) give the same tokens; two chunks a rank under pp2+vpp2.
        compiled = cpu_pool.run("decode_graphs.compile_backend, model.decoder = 'eager', None\ntry:\n    got = "
                                + code.replace("stream=False", "stream=False, compile=True") +
                                "\nfinally:\n    decode_graphs.compile_backend = 'inductor'\n"
                                "(got, len(model.decoder.compiled_blocks), model.decoder.compile_failed)", quiet=True)
        assert same_on_every_rank(compiled) == (reference, 2, None)
        cpu_pool.run("model.decoder = None", quiet=True)
        # An MoE model (Megatron's token dispatch: run uncaptured on GPUs) through the same step, under ep2.
        cpu_pool.run("moe = mnb.gpt('moe-tiny')\nref_moe = reference(moe, " + repr(PROMPTS) + ", 8)",
                     layout=ParallelConfig(ep=2), quiet=True)
        moe = cpu_pool.run(STANDIN.format(on=True) + f"mnb.generate(moe, {PROMPTS}, max_new_tokens=8, stream=False)",
                           quiet=True)
        assert same_on_every_rank(moe) == same_on_every_rank(cpu_pool.pull("ref_moe"))
        again = cpu_pool.run("model = mnb.gpt('tiny')\n" + code, layout=ParallelConfig(pp=2, vpp=2), quiet=True)
        assert same_on_every_rank(again) == reference
        # Sampling on the device: top_k=1 is greedy; a seed repeats; another seed differs.
        sample = "mnb.generate(model, {PROMPTS}, max_new_tokens=20, temperature={t}, top_k={k}, seed={s}, stream=False)"
        one = cpu_pool.run(sample.format(PROMPTS=PROMPTS, t=2.0, k=1, s=3), quiet=True)
        assert same_on_every_rank(one) == reference
        first = same_on_every_rank(cpu_pool.run(sample.format(PROMPTS=PROMPTS, t=1.0, k=0, s=7), quiet=True))
        assert first == same_on_every_rank(cpu_pool.run(sample.format(PROMPTS=PROMPTS, t=1.0, k=0, s=7), quiet=True))
        assert first != same_on_every_rank(cpu_pool.run(sample.format(PROMPTS=PROMPTS, t=1.0, k=0, s=8), quiet=True))
        # Buckets: 3 prompts -> 4 rows, 7 + 20 positions -> 256; 4 prompts reuse them, 6 make a second.
        # Prompts of up to 7 tokens -> a prefill bucket of 64 positions, its graphs beside the decode step's.
        code = ("d = model.decoder\n(sorted(d.entries), d.captures, sorted(k for e in d.entries.values() "
                "for k in e.graphs), sorted((n, k) for e in d.entries.values() for n, p in e.prefills.items() "
                "for k in p.graphs))")
        books = cpu_pool.run(code, quiet=True)  # pp2+vpp2: rank r holds virtual stages r and r + 2
        stages = {r: [(r, False), (r, True), (r + 2, False), (r + 2, True)] for r in (0, 1)}
        assert books == {r: ([(4, 256)], 8, [(*k, False) for k in stages[r]], [(64, k) for k in stages[r]])
                         for r in (0, 1)}  # decode graphs also by compile=
        captures = books[0][1]
        cpu_pool.run(f"mnb.generate(model, {PROMPTS + [[1, 2]]}, max_new_tokens=4, stream=False)", quiet=True)
        assert same_on_every_rank({r: v[:2] for r, v in cpu_pool.run(code, quiet=True).items()}) == ([(4, 256)], captures)
        cpu_pool.run(f"mnb.generate(model, {PROMPTS * 2}, max_new_tokens=4, stream=False)", quiet=True)
        assert same_on_every_rank({r: v[0] for r, v in cpu_pool.run(code, quiet=True).items()}) == [(4, 256), (8, 256)]
        # A layout change releases the graphs with the model; del frees them.
        cpu_pool.run("old = model", layout=ParallelConfig(tp=2), quiet=True)
        assert same_on_every_rank(cpu_pool.run("(old.decoder, bool(old.released))", quiet=True)) == (None, True)
        freed = ("import gc, weakref\nmodel = mnb.gpt('tiny')\nmnb.generate(model, [[1, 2]], max_new_tokens=2, "
                 "stream=False)\nw = weakref.ref(model.decoder)\ndel model\ngc.collect()\nw() is None")
        assert same_on_every_rank(cpu_pool.run(freed, quiet=True)) is True
    finally:
        cpu_pool.run(STANDIN.format(on=False) + "decode_graphs.sdpa_decode = False\n", quiet=True)


CAPTURE_FALLBACKS = """
import torch
from mnb.megatron import decode_graphs
d = decode_graphs.decoder_of(mnb.gpt('tiny'))
Real, seen = decode_graphs.Graph, []
class Refused:
    captured = True
    def __init__(self, step):
        seen.append((d.compile_failed is None, d.kernels))
        if len(seen) <= refuse:
            raise RuntimeError(f'refused {len(seen)}')
def capture(n, only_rank=None):
    global refuse
    refuse = n if only_rank in (None, torch.distributed.get_rank()) else 0
    d.compile_failed, d.kernels, d.capture_notes = None, True, []
    d.state.attend = decode_graphs.decode_attention  # as run() sets it before capturing
    seen.clear()
    decode_graphs.Graph = Refused
    try:
        return type(d._capture(lambda: None, compiled=True)).__name__, list(seen), list(d.capture_notes)
    finally:
        decode_graphs.Graph = Real
[capture(n) for n in (1, 2, 3, 9)] + [capture(1, only_rank=1)]
"""


def test_a_decode_step_that_does_not_capture_is_tried_again_then_gives_up_one_thing_at_a_time(cpu_pool, capsys):
    """GPU ranks capture the decode step as a CUDA graph; when that fails (here a stand-in ``Graph`` that
    refuses), it is tried once more as it is, then without the compiled layers, then without mnb's Triton
    kernels, last uncaptured; every rank takes the same branch, also when one rank alone failed (each
    attempt runs the step's collectives); each failure is kept in ``capture_notes``, printed by rank 0."""
    out = cpu_pool.run(CAPTURE_FALLBACKS, quiet=True)
    for rank, (first, both, three, never, one_rank) in out.items():
        refused = lambda *n: "; ".join(f"rank {rank}: RuntimeError: refused {i}" for i in n)  # noqa: E731
        # (compiled layers still on, mnb's kernels still on) at each try
        assert first == ("Refused", [(True, True), (True, True)],
                         [f"the decode step captured at the second try; the first failed: {refused(1)}"])
        assert both == ("Refused", [(True, True), (True, True), (False, True)],
                        [f"the decode step did not capture with compiled layers ({refused(1, 2)}); "
                         "captured it without"])
        assert three == ("Refused", [(True, True), (True, True), (False, True), (False, False)],
                         [f"the decode step did not capture with compiled layers, mnb's Triton kernels "
                          f"({refused(1, 2, 3)}); captured it without"])
        assert never[0] == "Eager" and len(never[1]) == 4  # the attention is not compiled: nothing more to drop
        assert never[2] == [f"CUDA graph capture of the decode step failed ({refused(1, 2, 3, 4)}); decoding "
                            "without graphs (slower)"]
        # rank 1 alone refused: rank 0 captured, yet tries again with it
        assert one_rank[:2] == ("Refused", [(True, True), (True, True)]), one_rank
        first_failed = "another rank's capture failed" if rank == 0 else refused(1)
        assert one_rank[2] == [f"the decode step captured at the second try; the first failed: {first_failed}"]
    capsys.readouterr()
    cpu_pool.run("capture(9)\nNone")
    shown = capsys.readouterr().out
    assert shown.count("mnb.generate: CUDA graph capture of the decode step failed (rank 0: RuntimeError: "
                       "refused 1") == 1, shown  # rank 0 only


def test_a_trained_model_generates_the_same_text_after_a_live_relayout(cpu_pool, tmp_path):
    ckpt = tmp_path / "ckpt"
    cpu_pool.run("model = mnb.gpt('tiny')\n"
                 "mnb.train(model, steps=3, micro_batch_size=2, global_batch_size=4, data='stdlib', lr=3e-3)\n"
                 f"mnb.save({str(ckpt)!r}, model)\n"
                 "texts = mnb.generate(model, ['def ', 'import os'], max_new_tokens=24, stream=False)",
                 layout=ParallelConfig(tp=2), quiet=True)
    before = same_on_every_rank(cpu_pool.pull("texts"))
    assert isinstance(before, list) and len(before) == 2 and all(isinstance(t, str) for t in before)
    after = cpu_pool.run(f"model = mnb.gpt('tiny')\nmnb.load({str(ckpt)!r}, model)\n"
                         "mnb.generate(model, ['def ', 'import os'], max_new_tokens=24, stream=False)",
                         layout=ParallelConfig(pp=2), quiet=True)
    assert same_on_every_rank(after) == before
    text = cpu_pool.run("mnb.generate(model, 'def ', max_new_tokens=24, stream=False)", quiet=True)
    assert same_on_every_rank(text) == before[0]  # one string in, one string out


def test_sampling_repeats_by_seed_across_layouts_and_stop_strings_end_text(cpu_pool):
    sample = ("mnb.generate(model, ['The ', 'x = '], max_new_tokens=40, temperature={t}, top_k={k}, "
              "top_p={p}, seed={s}, stream=False)")
    cpu_pool.run("model = mnb.gpt('tiny')", layout=ParallelConfig(tp=2), quiet=True)
    first = same_on_every_rank(cpu_pool.run(sample.format(t=1.0, k=0, p=1.0, s=7), quiet=True))
    again = same_on_every_rank(cpu_pool.run(sample.format(t=1.0, k=0, p=1.0, s=7), quiet=True))
    other = same_on_every_rank(cpu_pool.run(sample.format(t=1.0, k=0, p=1.0, s=8), quiet=True))
    assert first == again and first != other
    greedy = same_on_every_rank(cpu_pool.run(sample.format(t=0.0, k=0, p=1.0, s=7), quiet=True))
    assert greedy != first
    nucleus = same_on_every_rank(cpu_pool.run(sample.format(t=0.8, k=20, p=0.9, s=7), quiet=True))
    cpu_pool.run("model = mnb.gpt('tiny')", layout=ParallelConfig(pp=2), quiet=True)
    assert same_on_every_rank(cpu_pool.run(sample.format(t=1.0, k=0, p=1.0, s=7), quiet=True)) == first
    assert same_on_every_rank(cpu_pool.run(sample.format(t=0.8, k=20, p=0.9, s=7), quiet=True)) == nucleus
    # top_k=1 is greedy whatever the temperature.
    assert same_on_every_rank(cpu_pool.run(sample.format(t=2.0, k=1, p=1.0, s=3), quiet=True)) == greedy
    # A stop string ends the continuation before it; the text before it is the greedy text's.
    full = greedy[0]
    stop = full[10:12]
    cut = same_on_every_rank(cpu_pool.run(
        f"mnb.generate(model, 'The ', max_new_tokens=40, stop=['\\u2603', {stop!r}], stream=False)", quiet=True))
    assert cut == full[: full.find(stop)] and len(cut) <= 10
    ids = same_on_every_rank(cpu_pool.run(
        f"mnb.generate(model, list(b'The '), max_new_tokens=40, stop={stop!r}, stream=False)", quiet=True))
    text = bytes(i for i in ids if i < 256).decode("utf-8", "replace")  # what the byte tokenizer shows
    assert stop in text and text.startswith(cut) and len(ids) < 40


def test_an_interrupt_stops_every_rank_at_the_same_token_and_the_pool_stays_usable(cpu_pool):
    cpu_pool.run("model = mnb.gpt('tiny', max_position_embeddings=4096)", layout=ParallelConfig(pp=2), quiet=True)
    restarts = cpu_pool.restarts  # the pool is the session's: count from here
    seen = []

    def interrupt_after_three_tokens(rank, kind, payload):
        if kind == "generate":
            seen.append(payload["texts"])
            if len(seen) == 3:
                _thread.interrupt_main()  # what Kernel -> Interrupt does to the kernel

    cpu_pool.event_handlers.append(interrupt_after_three_tokens)
    with pytest.raises(KeyboardInterrupt):
        cpu_pool.run("try:\n    mnb.generate(model, ['a', 'bc'], max_new_tokens=4000)\n"
                     "except KeyboardInterrupt as err:\n    message = str(err)\n    raise")
    cpu_pool.event_handlers.clear()
    message = same_on_every_rank(cpu_pool.pull("message"))
    assert "stopped on every rank after" in message and int(message.split("after ")[1].split()[0]) < 4000
    assert len(seen[0]) == 2 and seen[0][0].startswith("a") and seen[0][1].startswith("bc")
    assert cpu_pool.restarts == restarts
    # Usable at once: the same greedy text as a fresh call, from a cell that runs an asyncio loop.
    plain = same_on_every_rank(cpu_pool.run("mnb.generate(model, 'ab', max_new_tokens=6, stream=False)", quiet=True))
    looped = cpu_pool.run("import asyncio\n"
                          "async def ask():\n"
                          "    await asyncio.sleep(0)\n"
                          "    return mnb.generate(model, 'ab', max_new_tokens=6, stream=False)\n"
                          "asyncio.run(ask())", quiet=True)
    assert same_on_every_rank(looped) == plain


def test_evaluate_equals_the_loss_the_logits_imply_and_train_records_it(cpu_pool):
    implied = """
import torch
from mnb.megatron.batches import build_dataset
data = build_dataset('stdlib', model.config, model.config.seq_length, 4, 1234, tokenizer=model.tokenizer)
tokens = torch.stack([torch.as_tensor(data[i]['tokens']) for i in range(4)])
labels = torch.stack([torch.as_tensor(data[i]['labels']) for i in range(4)])
mask = torch.stack([torch.as_tensor(data[i]['loss_mask']) for i in range(4)]).float()
logits = mnb.logits(model, tokens)
nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(), reduction='none')
(float((nll * mask.flatten()).sum() / mask.sum()), int(mask.sum()))
"""
    # 300 ids padded to 512 (tp2) or 384 (tp1) by Megatron: the padding is no part of the loss.
    cpu_pool.run("model = mnb.gpt('tiny', vocab_size=300)", layout=ParallelConfig(tp=2), quiet=True)
    loss, tokens = same_on_every_rank(cpu_pool.run(implied, quiet=True))
    under_tp = same_on_every_rank(cpu_pool.run(
        "mnb.evaluate(model, data='stdlib', batches=2, micro_batch_size=2)", quiet=True))
    assert under_tp["tokens"] == tokens
    assert under_tp["loss"] == pytest.approx(loss, rel=1e-5)
    assert under_tp["perplexity"] == pytest.approx(2.718281828 ** loss, rel=1e-5)
    cpu_pool.run("model = mnb.gpt('tiny', vocab_size=300)", layout=ParallelConfig(), quiet=True)  # dp2: samples split over ranks
    under_dp = same_on_every_rank(cpu_pool.run(
        "mnb.evaluate(model, data='stdlib', batches=1, micro_batch_size=2)", quiet=True))
    assert under_dp["tokens"] == tokens and under_dp["loss"] == pytest.approx(loss, rel=1e-5)
    with pytest.raises(Exception, match="batches must be a positive integer"):
        cpu_pool.run("mnb.evaluate(model, data='stdlib', batches=0)", quiet=True)
    # Every 2 steps during training, on held-out data; the last evaluation is the model's loss now.
    cpu_pool.run("model = mnb.gpt('tiny', vocab_size=300)", layout=ParallelConfig(pp=2), quiet=True)
    cpu_pool.run("mnb.train(model, steps=4, micro_batch_size=2, global_batch_size=4, data='stdlib', lr=3e-3,\n"
                 "          eval_data='mock', eval_every=2, eval_batches=2)", quiet=True)
    run = mnb.last_run
    evals = run.eval_losses
    assert [e is None for e in evals] == [True, False, True, False], evals
    now = same_on_every_rank(cpu_pool.run("mnb.evaluate(model, data='mock', batches=2, micro_batch_size=2)",
                                          quiet=True))
    assert evals[3] == pytest.approx(now["loss"], rel=1e-6) and evals[1] != evals[3]
    assert "eval loss" in run.summary() and "2 evaluations" in run.summary()
    ax = run.plot_loss()
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["evaluation loss"].get_xdata()) == [2, 4]  # steps counted from 1, as everywhere
    assert list(lines["evaluation loss"].get_ydata()) == [evals[1], evals[3]]
    assert len(lines["training loss"].get_xdata()) == 4
    # a later call carries the settings earlier calls named (eval_data too): a fresh model has none
    with pytest.raises(Exception, match="eval_every=2 needs eval_data"):
        cpu_pool.run("fresh = mnb.gpt('tiny', vocab_size=300)\nmnb.train(fresh, steps=2, eval_every=2)", quiet=True)


IMPLIED_ON_TEXT = """
import torch
from mnb.megatron.data import dataset_for
_ds = dataset_for({text!r}, model.config, model.config.seq_length, 1, 1234, tokenizer=model.tokenizer)
assert len(_ds) >= 4, len(_ds)  # one epoch: the first samples of any sample count
_tokens = torch.stack([torch.as_tensor(_ds[i]['tokens']) for i in range(4)])
_labels = torch.stack([torch.as_tensor(_ds[i]['labels']) for i in range(4)])
_mask = torch.stack([torch.as_tensor(_ds[i]['loss_mask']) for i in range(4)]).float().flatten()
_logits = mnb.logits(model, _tokens)
_nll = torch.nn.functional.cross_entropy(_logits.flatten(0, 1).double(), _labels.flatten(), reduction='none')
(float((_nll * _mask).sum() / _mask.sum()), int(_mask.sum()), _tokens.tolist())
"""


@pytest.fixture(scope="module")
def hf_llama_with_bpe(tmp_path_factory):
    """A tiny random Llama with a 300-id byte-level BPE trained here, and a text folder."""
    import shutil

    from hf_tokenizers import PARAGRAPH, llama_style
    from test_hf import _build

    root = tmp_path_factory.mktemp("hf-evaluate")
    folder = root / "llama"
    _build(folder, "llama")
    tokenizer = llama_style(root / "tokenizer", vocab_size=300)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    text = root / "text"
    text.mkdir()
    (text / "paragraph.txt").write_text(PARAGRAPH * 40, encoding="utf-8")
    return str(folder), str(text)


def _is_run_of(row: list[int], stream: list[int]) -> bool:
    return any(stream[i:i + len(row)] == row for i in range(len(stream) - len(row) + 1))


def test_evaluate_of_a_hf_model_reads_text_through_its_tokenizer(cpu_pool, hf_llama_with_bpe):
    """mnb.evaluate and mnb.train(eval_data=...) read text as training does: through the checkpoint's
    tokenizer (not mnb's byte tokenizer, whose ids fit any real vocabulary, so nothing complained)."""
    from transformers import AutoTokenizer

    folder, text = hf_llama_with_bpe
    load = f"model = mnb.from_hf({folder!r}, seq_length=32)"
    implied = IMPLIED_ON_TEXT.format(text=text)
    cpu_pool.run(load, quiet=True)  # 1 rank (dp2): each rank holds the whole model
    loss, tokens, rows = same_on_every_rank(cpu_pool.run(implied, quiet=True))
    # The reference tokens are the checkpoint tokenizer's: runs of transformers' encoding of the document.
    hf = AutoTokenizer.from_pretrained(folder)
    with open(f"{text}/paragraph.txt", encoding="utf-8") as f:
        document = hf(f.read()).input_ids + [hf.eos_token_id]  # BOS from its post-processor, mnb's eod
    assert all(_is_run_of(row, document * 2) for row in rows), rows
    one_rank = same_on_every_rank(cpu_pool.run(
        "mnb.evaluate(model, data=" + repr(text) + ", batches=1, micro_batch_size=2)", quiet=True))
    assert one_rank["tokens"] == tokens
    assert one_rank["loss"] == pytest.approx(loss, rel=1e-5)
    cpu_pool.run(load, layout=ParallelConfig(tp=2), quiet=True)  # a re-layout of the same pool
    under_tp = same_on_every_rank(cpu_pool.run(
        "mnb.evaluate(model, data=" + repr(text) + ", batches=2, micro_batch_size=2)", quiet=True))
    assert under_tp["tokens"] == tokens and under_tp["loss"] == pytest.approx(loss, rel=1e-5)
    # Evaluation while training reads the same tokens: the last one is the trained model's implied loss.
    cpu_pool.run("mnb.train(model, steps=2, micro_batch_size=2, global_batch_size=4, data=" + repr(text) + ",\n"
                 "          lr=3e-3, eval_data=" + repr(text) + ", eval_every=2, eval_batches=2)", quiet=True)
    evals = mnb.last_run.eval_losses
    trained, trained_tokens, trained_rows = same_on_every_rank(cpu_pool.run(implied, quiet=True))
    assert trained_rows == rows and trained != pytest.approx(loss, rel=1e-3)
    assert evals[0] is None and evals[1] == pytest.approx(trained, rel=1e-5), (evals, trained)


def test_bad_arguments_are_refused_before_any_collective(cpu_pool):
    cpu_pool.run("model = mnb.gpt('tiny')", quiet=True)
    for call, match in (
        ("mnb.generate(model, [])", "prompts must be"),
        ("mnb.generate(model, [[1, 2], 'x'])", "mixes them"),
        ("mnb.generate(model, 'x', max_new_tokens=-1)", "max_new_tokens must be an integer >= 0"),
        ("mnb.generate(model, 'x', top_p=0)", r"top_p must lie in \(0, 1\]"),
        ("mnb.generate(model, 'x', temperature=-1)", "temperature must be >= 0"),
        ("mnb.generate(model, 'x', max_new_tokens=200)", "exceeds the model's max_position_embeddings"),
        ("mnb.generate(model, [[1, 9999]])", r"outside the model's vocabulary \[0, 512\)"),
        ("mnb.generate(model, 'x', compile='yes')", "compile must be True or False"),
        ("mnb.generate(model, 'x', temperature=1.0, seed=None)", "seed must be an integer"),
        ("mnb.train(model, steps=1, lr=float('nan'))", r"lr must be a positive, finite number, got nan"),
    ):
        with pytest.raises(Exception, match=match):
            cpu_pool.run(call, quiet=True)
    assert cpu_pool.run("mnb.generate(model, 'ok', max_new_tokens=2, stream=False) is not None", quiet=True) == {
        0: True, 1: True}
    # nothing to generate: empty continuations in the prompts' shape, as transformers gives (user trial)
    assert cpu_pool.run("(mnb.generate(model, 'ok', max_new_tokens=0), mnb.generate(model, ['a', 'b'], max_new_tokens=0),"
                        " mnb.generate(model, [[1, 2]], max_new_tokens=0))", quiet=True) == {
        0: ("", ["", ""], [[]]), 1: ("", ["", ""], [[]])}
    cpu_pool.run("model = mnb.gpt('tiny')", layout=ParallelConfig(cp=2), quiet=True)
    with pytest.raises(Exception, match=r"does not run under context parallelism \(cp=2\).*--tp 2"):
        cpu_pool.run("mnb.generate(model, 'x')", quiet=True)


HF_PROMPTS = [[11, 250, 3, 77, 140, 9, 31, 200, 5, 66], [42, 7], [299, 1, 150, 12, 88]]
HF_LAYOUTS = {
    "dp2": (ParallelConfig(), ("llama", "qwen2", "gpt2", "mixtral")),
    "tp2": (ParallelConfig(tp=2), ("llama", "qwen2", "gpt2")),
    "pp2": (ParallelConfig(pp=2), ("llama", "qwen2", "gpt2", "mixtral")),
    "ep2": (ParallelConfig(ep=2), ("mixtral",)),
    "tp2+sp": (ParallelConfig(tp=2, sequence_parallel=True), ("mixtral",)),  # MoE under tp needs sp
}


@pytest.fixture(scope="module")
def hf_greedy(tmp_path_factory):
    """kind -> (folder, transformers' greedy continuations of HF_PROMPTS, one prompt at a time)."""
    import torch
    from test_hf import _build

    root = tmp_path_factory.mktemp("hf-generate")
    out = {}
    for kind in ("llama", "qwen2", "gpt2", "mixtral"):
        model = _build(root / kind, kind).eval()
        continuations = []
        for prompt in HF_PROMPTS:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                full = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                                      pad_token_id=model.config.eos_token_id)
            continuations.append(full[0, len(prompt):].tolist())
        assert max(len(c) for c in continuations) == 32, (kind, continuations)  # not ended at once by eos
        out[kind] = (str(root / kind), continuations)
    return out


@pytest.mark.parametrize("layout_name", list(HF_LAYOUTS))
def test_greedy_equals_transformers_generate(cpu_pool, hf_greedy, layout_name):
    layout, kinds = HF_LAYOUTS[layout_name]
    paths = {kind: hf_greedy[kind][0] for kind in kinds}
    got = cpu_pool.run(f"_out = {{}}\n"
                       f"for _kind, _path in {paths!r}.items():\n"
                       f"    _m = mnb.from_hf(_path)\n"
                       f"    _out[_kind] = mnb.generate(_m, {HF_PROMPTS!r}, max_new_tokens=32, stream=False)\n"
                       f"del _m\n_out", layout=layout, quiet=True)
    for kind in kinds:
        want = hf_greedy[kind][1]
        assert same_on_every_rank({r: v[kind] for r, v in got.items()}) == want, (layout_name, kind)
