"""Hugging Face tokenizer folders for tests, trained here with ``tokenizers`` on local text.

    llama_style(tmp / "llama")   # byte-level BPE, <|begin_of_text|> added by its post-processor
    gpt2_style(tmp / "gpt2")     # byte-level BPE, <|endoftext|> = bos = eos, nothing added

Both are laid out as their real models' folders are (``tokenizer.json``,
``tokenizer_config.json``, ``config.json``), with ``vocab_size`` ids (specials included), so
``transformers.AutoTokenizer.from_pretrained(folder)`` loads them as it loads the real ones.
Training text: a paragraph written here and the first 200 KB of Python's standard library
(present offline everywhere); deterministic for a given Python build. No downloads.
"""

from __future__ import annotations

import json
from pathlib import Path

PARAGRAPH = (
    "The notebook kernel drives a pool of ranks. Every rank holds its part of the model: "
    "tensor parallel ranks split each weight, pipeline stages hold consecutive layers, and "
    "data parallel ranks read different samples of the same global batch. Caf\u00e9, na\u00efve, "
    "\u65e5\u672c\u8a9e and \u2713 are text too.\n\n"
)


def _texts() -> list[str]:
    from mnb.megatron.corpora import stdlib_files

    return [PARAGRAPH * 20] + [p.read_text(encoding="utf-8") for p in stdlib_files(200_000)]


def _train(specials: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(), trainer)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def _write(folder: Path, tok, tokenizer_config: dict, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": tok.get_vocab_size()}, indent=1))
    return folder


def llama_style(folder: Path, vocab_size: int = 384) -> Path:
    """Llama 3's layout: BOS/EOS named in tokenizer_config.json, BOS added by the post-processor."""
    from tokenizers import processors

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = _train([bos, eos], vocab_size)
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                      special_tokens=[(bos, bos_id)]),
    ])
    return _write(folder, tok,
                  {"bos_token": bos, "eos_token": eos, "clean_up_tokenization_spaces": False,
                   "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"},
                  {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "bos_token_id": bos_id, "eos_token_id": tok.token_to_id(eos)})


def gpt2_style(folder: Path, vocab_size: int = 320) -> Path:
    """GPT-2's layout: one <|endoftext|> for bos, eos and unk; nothing added when encoding."""
    from tokenizers import processors

    end = "<|endoftext|>"
    tok = _train([end], vocab_size)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    end_id = tok.token_to_id(end)
    return _write(folder, tok,
                  {"bos_token": end, "eos_token": end, "unk_token": end, "add_prefix_space": False,
                   "model_max_length": 1024, "tokenizer_class": "GPT2Tokenizer"},
                  {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                   "bos_token_id": end_id, "eos_token_id": end_id})
