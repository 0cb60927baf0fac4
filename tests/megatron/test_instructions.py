"""Instruction data on real CPU ranks: the loss on answers only, packed or not, equals transformers'.

A tiny Llama checkpoint built here with transformers (vocabulary 300: Megatron pads it, so the
padding columns must stay out of the loss) and a tokenizer trained here on local text
(``hf_tokenizers.llama_style``: a BOS its post-processor adds, as Llama 3's) with a ChatML-like
chat template.  The reference is transformers' cross entropy computed one example at a time:
prompt/completion tokens as TRL's SFTTrainer builds them, chat tokens from
``apply_chat_template`` with transformers' own assistant mask (the same template marked with
``{% generation %}``).  One 2-rank pool for the module.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from mnb.config import ParallelConfig
from mnb.errors import CompositeRankError

pytestmark = pytest.mark.slow

SEQ = 96
RTOL = 1e-5

CHAT = ("{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] }}<|end_of_text|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|begin_of_text|>assistant: {% endif %}")
CHAT_MARKED = ("{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: "
               "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end_of_text|>\n{% endgeneration %}"
               "{% else %}{{ m['content'] }}<|end_of_text|>\n{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<|begin_of_text|>assistant: {% endif %}")

ROWS = [
    {"prompt": "The notebook kernel drives", "completion": " a pool of ranks."},
    {"prompt": "Every rank holds", "completion": " its part of the model: tensor parallel ranks split each weight."},
    {"prompt": "Pipeline stages hold", "completion": " consecutive layers"},
    {"prompt": "def main():\n", "completion": "    return 0\n"},
    {"prompt": "Caf\u00e9, na\u00efve and", "completion": " \u2713 are text too."},
    {"prompt": "import os", "completion": "\nimport sys"},
    {"prompt": "data parallel ranks read", "completion": " different samples of the same global batch."},
]
CHATS = [
    {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What drives ranks?"},
                  {"role": "assistant", "content": "The notebook kernel."}]},
    {"messages": [{"role": "user", "content": "Split weights?"}, {"role": "assistant", "content": "Tensor parallel."},
                  {"role": "user", "content": "And layers?"}, {"role": "assistant", "content": "Pipeline stages."}]},
    {"messages": [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "import sys"}]},
    # the assistant speaks first: its role header is the prompt's, not the answer's (user trial 12-05; the
    # template renders no empty conversation, so the header is found from the turn after a user's message)
    {"messages": [{"role": "assistant", "content": "Ready."}, {"role": "user", "content": "Go on."},
                  {"role": "assistant", "content": "Done."}]},
]


def _write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _reference(folder, rows):
    """transformers' summed cross entropy and token count over the answer tokens, one example at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for row in rows:
        if "messages" in row:
            out = tok.apply_chat_template(row["messages"], chat_template=CHAT_MARKED, tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=True)
            ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
            assert ids == list(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])
        else:
            prompt = tok(row["prompt"])["input_ids"]
            completion = tok(row["completion"], add_special_tokens=False)["input_ids"]
            ids = prompt + completion + [tok.eos_token_id]
            mask = [0] * len(prompt) + [1] * (len(completion) + 1)
        labels = torch.tensor([[-100 if not m else i for i, m in zip(ids, mask)]])
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits.float()
        losses = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="none", ignore_index=-100)
        total += float(losses.sum())
        count += int((labels[0, 1:] != -100).sum())
    return total, count


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    import torch
    from hf_tokenizers import llama_style
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("sft")
    folder = root / "llama"
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                         intermediate_size=96, num_hidden_layers=4, vocab_size=300,
                                         max_position_embeddings=128, initializer_range=0.1, rope_theta=10000.0))
    model.save_pretrained(folder)
    tokenizer = llama_style(root / "tokenizer", vocab_size=300)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    shutil.copy(tokenizer / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT}))
    plain = root / "no-template"
    shutil.copytree(folder, plain)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    rows = _write_rows(root / "rows.jsonl", ROWS)
    chats = _write_rows(root / "chats.jsonl", CHATS)
    return {"folder": str(folder), "plain": str(plain), "rows": rows, "chats": chats, "root": root,
            "ref_rows": _reference(str(folder), ROWS), "ref_chats": _reference(str(folder), CHATS)}


def _cell(folder, cases: dict) -> str:
    lines = [f"_m = mnb.from_hf({folder!r}, seq_length={SEQ})", "_out = {}"]
    for name, code in cases.items():
        lines.append(f"_out[{name!r}] = {code}")
    return "\n".join(lines + ["del _m", "_out"])


def _close(got: dict, want: tuple, label: str) -> None:
    total, count = want
    assert got["tokens"] == count, (label, got, count)
    assert got["loss"] == pytest.approx(total / count, rel=RTOL), (label, got["loss"], total / count)


@pytest.mark.parametrize("layout", [ParallelConfig(tp=2), ParallelConfig(pp=2), ParallelConfig(pp=2, vpp=2)],
                         ids=["tp2", "pp2", "pp2-vpp2"])  # vpp: chunks in the middle need the mask too
def test_evaluate_equals_transformers_packed_and_unpacked(cpu_pool, sft, layout):
    """Every example once (batches=None), packed and one per sequence; chat data on assistant turns only."""
    rows, chats = sft["rows"], sft["chats"]
    results = cpu_pool.run(_cell(sft["folder"], {
        "packed": f"mnb.evaluate(_m, data={rows!r}, batches=None, micro_batch_size=2)",
        "unpacked": f"mnb.evaluate(_m, data={rows!r}, batches=None, pack=False)",
        "chat": f"mnb.evaluate(_m, data={chats!r}, batches=None)",
        "sequences": f"[mnb.megatron.batches.samples(_m, {rows!r}, 1, pack=_p).epoch_size for _p in (True, False)]",
    }), layout=layout, quiet=True)
    for rank, out in results.items():
        label = f"{layout} rank {rank}"
        _close(out["packed"], sft["ref_rows"], label + " packed")
        _close(out["unpacked"], sft["ref_rows"], label + " unpacked")
        _close(out["chat"], sft["ref_chats"], label + " chat")
        packed, unpacked = out["sequences"]
        assert unpacked == len(ROWS) and packed < unpacked, (label, out["sequences"])


def test_cp2_pads_and_training_loss_excludes_vocab_padding(cpu_pool, sft, capsys):
    """cp2 cannot isolate packed examples: one per sequence (said once), same loss.  tp2: the first
    training step's loss over one batch of every example is transformers' (no vocab padding in it),
    and mnb.last_run reports how full the sequences were."""
    rows = sft["rows"]
    capsys.readouterr()
    out = cpu_pool.run(_cell(sft["folder"], {"eval": f"mnb.evaluate(_m, data={rows!r}, batches=None)",
                                             "again": f"mnb.evaluate(_m, data={rows!r}, batches=None)"}),
                       layout=ParallelConfig(cp=2), quiet=False)
    for rank, got in out.items():
        _close(got["eval"], sft["ref_rows"], f"cp2 rank {rank}")
        assert got["again"] == got["eval"], got
    printed = capsys.readouterr().out
    assert printed.count("instruction data is padded, one example per sequence, not packed (cp=2") == 1, printed
    n = cpu_pool.run(_cell(sft["folder"], {"n": f"mnb.megatron.batches.samples(_m, {rows!r}, 1234).epoch_size"}),
                     layout=ParallelConfig(tp=2), quiet=True)[0]["n"]
    assert n < len(ROWS), n  # packed
    cell = _cell(sft["folder"], {  # one global batch of every sequence, so of every example
        "train": f"mnb.train(_m, steps=1, data={rows!r}, micro_batch_size=1, global_batch_size={n}, "
                 "lr=1e-3)['steps'][0]['loss']",
    })
    out = cpu_pool.run(cell, layout=ParallelConfig(tp=2), quiet=True)
    total, count = sft["ref_rows"]
    for rank, got in out.items():
        assert got["train"] == pytest.approx(total / count, rel=RTOL), (rank, got["train"], total / count)
    import mnb

    packing = mnb.last_run.packing
    assert (packing["examples"], packing["sequences"], packing["packed"]) == (len(ROWS), n, True), packing
    assert packing["loss_tokens"] == count and 0.5 < packing["fill"] <= 1, packing


def test_bad_rows_are_refused_alike_on_every_rank(cpu_pool, sft):
    root = sft["root"] / "bad"
    root.mkdir()
    missing = _write_rows(root / "missing.jsonl", [ROWS[0], {"prompt": "only a prompt"}])
    (root / "broken.jsonl").write_text(json.dumps(ROWS[0]) + "\n\n{\"prompt\": \"x\",\n")
    broken = str(root / "broken.jsonl")
    no_role = _write_rows(root / "no-role.jsonl", [{"messages": [{"content": "hi"}]}])
    long = _write_rows(root / "long.jsonl", [ROWS[0], ROWS[1], {"prompt": "word " * 150, "completion": "end"}])
    both = _write_rows(root / "both.jsonl", [{**ROWS[0], "messages": [{"role": "user", "content": "hi"}]}])
    no_eos = root / "no-eos"  # chat rows end with the template's end of turn; prompt/completion rows need an eos
    shutil.copytree(sft["folder"], no_eos)
    config = json.loads((no_eos / "tokenizer_config.json").read_text())
    (no_eos / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "eos_token"}))
    cases = [
        (both, sft["folder"], ["both.jsonl, line 1: a row has 'messages' and 'prompt'/'completion': give one form"]),
        (missing, sft["folder"], ["missing.jsonl, line 2: 'completion' is missing"]),
        (broken, sft["folder"], ["broken.jsonl, line 3: not JSON"]),
        (no_role, sft["folder"], ["no-role.jsonl, line 1: messages[0] 'role' is missing"]),
        (long, sft["folder"], ["row 3 (", "long.jsonl:3) has ", "truncate=True"]),
        (sft["rows"], str(no_eos), ["rows.jsonl:1: ", "no-eos names no eos token, which ends every completion of a "
                                    "prompt/completion row"]),
        (sft["chats"], sft["plain"], ["chats.jsonl:1: a messages row needs a chat template",
                                      "add 'chat_template' to tokenizer_config.json or a chat_template.jinja"]),
    ]
    for data, folder, fragments in cases:
        with pytest.raises(CompositeRankError, match="2 of 2 ranks raised") as info:
            cpu_pool.run(f"_m = mnb.from_hf({folder!r}, seq_length={SEQ})\n"
                         f"mnb.evaluate(_m, data={data!r}, batches=None)",
                         layout=ParallelConfig(tp=2), quiet=True)
        text = str(info.value)
        assert "[r0-1] ValueError" in text, text  # one error, the same on both ranks
        assert all(f in text for f in fragments), text
    with pytest.raises(CompositeRankError, match="2 of 2 ranks raised") as info:  # training checks first too
        cpu_pool.run(f"_m = mnb.from_hf({sft['folder']!r}, seq_length={SEQ})\n"
                     f"mnb.train(_m, steps=1, data={sft['rows']!r}, eval_data={missing!r})",
                     layout=ParallelConfig(tp=2), quiet=True)
    assert "[r0-1] ValueError" in str(info.value) and "line 2: 'completion' is missing" in str(info.value)
    # truncate=True cuts the long row; the pool is still usable after all that.  A text file with
    # batches=None: every sequence of its first epoch once (in micro batches of 2; an odd count pads the last).
    text = root / "text.txt"
    text.write_text(open(json.__file__).read())
    out = cpu_pool.run(_cell(sft["folder"], {
        "long": f"mnb.evaluate(_m, data={long!r}, batches=None, truncate=True)['tokens']",
        "text": f"mnb.evaluate(_m, data={str(text)!r}, batches=None, micro_batch_size=2)['tokens']",
        "sequences": f"mnb.megatron.batches.samples(_m, {str(text)!r}, 1234).epoch_size",
    }), layout=ParallelConfig(tp=2), quiet=True)
    assert out[0] == out[1], out
    chats = cpu_pool.run(f"mnb.evaluate(mnb.from_hf({str(no_eos)!r}, seq_length={SEQ}), data={sft['chats']!r}, "
                         "batches=None)['tokens']", layout=ParallelConfig(tp=2), quiet=True)
    assert chats == {0: sft["ref_chats"][1], 1: sft["ref_chats"][1]}, chats
    # the long row's answer is past the cut: it has nothing to learn from and is left out (it gave a NaN loss)
    assert out[0]["long"] == _reference(sft["folder"], ROWS[:2])[1], out
    assert out[0]["text"] == out[0]["sequences"] * SEQ, out
    only_long = _write_rows(root / "only-long.jsonl", [{"prompt": "word " * 150, "completion": "end"}])
    with pytest.raises(CompositeRankError, match="2 of 2 ranks raised") as info:
        cpu_pool.run(f"_m = mnb.from_hf({sft['folder']!r}, seq_length={SEQ})\n"
                     f"mnb.train(_m, steps=1, data={only_long!r}, truncate=True)", layout=ParallelConfig(tp=2), quiet=True)
    assert "[r0-1] ValueError: truncate=True cut every row to seq_length=96 tokens before its answer began (row 1 (" \
        in str(info.value) and "nothing is left to learn from" in str(info.value), str(info.value)
    # a model without a checkpoint tokenizer reads prompt/completion as UTF-8 bytes, then its eod;
    # it has no chat template
    out = cpu_pool.run(f"_g = mnb.gpt('tiny', seq_length={SEQ})\n"
                       f"mnb.evaluate(_g, data={sft['rows']!r}, batches=None)['tokens']",
                       layout=ParallelConfig(tp=2), quiet=True)
    assert out[0] == out[1] == sum(len(r["completion"].encode()) + 1 for r in ROWS), out
    with pytest.raises(CompositeRankError, match="2 of 2 ranks raised") as info:
        cpu_pool.run(f"mnb.evaluate(mnb.gpt('tiny', seq_length={SEQ}), data={sft['chats']!r})",
                     layout=ParallelConfig(tp=2), quiet=True)
    assert "needs a chat template, and this model (mnb's byte tokenizer) has none" in str(info.value)
