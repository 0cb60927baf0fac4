"""Instruction data: JSON-lines rows -> examples with the loss on answers only -> (packed) samples.

``data=`` of ``mnb.train`` / ``mnb.evaluate`` (and ``eval_data=``) is instruction data when it
names ``.jsonl`` files (a file, a folder of them, a glob)::

    {"prompt": "2+2=", "completion": " 4"}
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

- prompt/completion, as TRL's ``SFTTrainer`` builds them: ``tokenizer(prompt)`` (with the
  tokenizer's own special tokens, e.g. Llama 3's BOS), then ``tokenizer(completion,
  add_special_tokens=False)``, then EOS; the loss covers the completion tokens and that EOS.
- messages: the checkpoint's chat template (``chat_template`` in ``tokenizer_config.json`` or
  ``chat_template.jinja``), tokenized as ``apply_chat_template(messages, tokenize=True)`` does;
  the loss covers the assistant turns only.  A template with ``{% generation %}`` marks them
  itself (transformers' ``return_assistant_tokens_mask``); otherwise each assistant turn is the
  text that rendering ``messages[:i+1]`` adds to ``messages[:i]`` with the generation prompt.

A model without a checkpoint tokenizer (``mnb.gpt``) reads prompt/completion rows as UTF-8
bytes ending with its eod id; it has no chat template, so messages rows are refused.

Samples are ``seq_length`` long: an example of ``n`` tokens fills ``n - 1`` positions (inputs
``ids[:-1]``, labels ``ids[1:]``).  Packed (:func:`samples`, ``pack=True``), consecutive
examples share a sequence; each gets ``segment_ids`` of its own and position ids from 0, and
:func:`attention_mask` lets each token see only earlier tokens of its own example.  RoPE needs
nothing more: a rotary score depends only on the distance between query and key, which is the
same inside an example wherever it sits; learned positions (GPT-2) read the restarted ids.
Unpacked, each sequence holds one example, right-padded; causal attention then already keeps
the padding out of sight.  Padding is never in the loss.

Everything here is deterministic and collective-free: every rank reads and checks the same
files, so a bad row raises the same ValueError on every rank before any collective.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SUFFIX = ".jsonl"


def files_of(data) -> list[Path] | None:
    """The ``.jsonl`` files ``data`` names, or None when it names no instruction data.

    A file ending in ``.jsonl``, a folder whose text files all do, or a glob matching only
    such files.  A folder or glob mixing them with other files is refused (ValueError).
    """
    if not isinstance(data, (str, os.PathLike)):
        return None
    text = os.fspath(data)
    path = Path(text).expanduser()
    if path.is_file():
        return [path] if path.name.endswith(SUFFIX) else None
    if path.is_dir():
        from mnb.megatron.corpora import resolve_text_files

        try:
            files = resolve_text_files(path)
        except FileNotFoundError:
            return None
    elif globlib.has_magic(text):
        files = sorted(Path(m) for m in globlib.glob(os.path.expanduser(text), recursive=True)
                       if Path(m).is_file())
    else:
        return None
    rows = [f for f in files if f.name.endswith(SUFFIX)]
    if not rows:
        return None
    if len(rows) != len(files):
        other = [str(f) for f in files if not f.name.endswith(SUFFIX)][:3]
        raise ValueError(
            f"data {text!r} mixes {len(rows)} {SUFFIX} file(s) (instruction rows) with "
            f"{len(files) - len(rows)} other file(s) ({', '.join(other)}): name only the {SUFFIX} "
            f"files (a glob such as '{text.rstrip('/')}/*{SUFFIX}') or only text files")
    return rows


@dataclass(frozen=True)
class Row:
    """One checked row: where it is, and its prompt/completion or messages."""

    file: str
    line: int
    prompt: str | None = None
    completion: str | None = None
    messages: tuple | None = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def read_rows(files: list[Path]) -> list[Row]:
    """Every non-blank line of ``files``, checked: ValueError naming file, line and what is wrong."""
    rows = []
    for path in files:
        with open(path, encoding="utf-8") as fh:
            for number, line in enumerate(fh, start=1):
                if line.strip():
                    rows.append(_row(str(path), number, line))
    if not rows:
        raise ValueError(f"instruction data {', '.join(map(str, files))} holds no rows: each line of a "
                         f"{SUFFIX} file is one JSON object with 'prompt' and 'completion' or 'messages'")
    return rows


def _row(file: str, line: int, text: str) -> Row:
    where = f"{file}, line {line}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object with 'prompt' and 'completion' or "
                         f"'messages', got {type(row).__name__}")
    if "messages" in row and ("prompt" in row or "completion" in row):  # which one would train is a guess
        raise ValueError(f"{where}: a row has 'messages' and 'prompt'/'completion': give one form per row")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of "
                             "{\"role\": ..., \"content\": ...} objects")
        for k, message in enumerate(messages):
            if not isinstance(message, dict):
                raise ValueError(f"{where}: messages[{k}] is not an object")
            for key in ("role", "content"):
                if not isinstance(message.get(key), str):
                    what = "is missing" if key not in message else "must be a string"
                    raise ValueError(f"{where}: messages[{k}] '{key}' {what}")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: no message has role 'assistant', so nothing would be in the loss")
        return Row(file, line, messages=tuple(dict(m) for m in messages))
    if "prompt" in row or "completion" in row:
        for key in ("prompt", "completion"):
            if key not in row:
                raise ValueError(f"{where}: '{key}' is missing (a prompt/completion row needs both)")
            if not isinstance(row[key], str):
                raise ValueError(f"{where}: '{key}' must be a string, got {type(row[key]).__name__}")
        return Row(file, line, prompt=row["prompt"], completion=row["completion"])
    raise ValueError(f"{where}: 'prompt' and 'completion' (or 'messages') are missing; "
                     f"the row has {sorted(row) or 'no keys'}")


# -- tokens and loss masks -----------------------------------------------------------


class Encoder:
    """Rows -> ``(ids, in_loss)`` with the model's tokenizer (transformers' APIs for a checkpoint's)."""

    def __init__(self, tokenizer) -> None:
        self.folder = getattr(tokenizer, "folder", None)
        self.hf = None
        if self.folder is not None:
            try:
                from transformers import AutoTokenizer
            except ImportError as err:
                raise ImportError(f"instruction data with a checkpoint's tokenizer needs transformers "
                                  f"(pip install transformers): {err}") from err
            self.hf = AutoTokenizer.from_pretrained(str(self.folder))
            # chat rows end with the template's own end-of-turn text: only prompt/completion rows need an eos
            # (:meth:`encode`); padding, which no loss reads, takes the pad token or 0 without one
            eos = self.hf.eos_token_id if self.hf.eos_token_id is not None else self.hf.pad_token_id
            self.eos = int(eos) if eos is not None else 0
        else:
            from mnb.megatron.tokenizer import EOD_ID

            self.eos = EOD_ID
        self.identity = (str(tokenizer.unique_identifiers) if tokenizer is not None else "bytes")

    def encode(self, row: Row) -> tuple[list[int], list[bool]]:
        if row.messages is not None:
            return self._chat(row)
        if self.hf is None:
            prompt, completion = list(row.prompt.encode()), list(row.completion.encode())
        elif self.hf.eos_token_id is None:
            raise ValueError(f"{row.where}: {self.folder} names no eos token, which ends every completion of a "
                             "prompt/completion row: add 'eos_token' to its tokenizer_config.json, or write the rows "
                             "as chat 'messages' (their template ends each turn)")
        else:
            prompt = list(self.hf(row.prompt)["input_ids"])
            completion = list(self.hf(row.completion, add_special_tokens=False)["input_ids"])
        ids = prompt + completion + [self.eos]
        return ids, [False] * len(prompt) + [True] * (len(completion) + 1)

    def _template(self, row: Row) -> str:
        template = getattr(self.hf, "chat_template", None) if self.hf is not None else None
        if not template:
            where = self.folder or "this model (mnb's byte tokenizer)"
            raise ValueError(
                f"{row.where}: a messages row needs a chat template, and {where} has none: add "
                "'chat_template' to tokenizer_config.json or a chat_template.jinja file to the "
                "checkpoint folder (or write the rows as prompt/completion)")
        if not isinstance(template, str):
            raise ValueError(f"{self.folder} has several named chat templates; mnb uses a single "
                             "'chat_template' string")
        return template

    def _chat(self, row: Row) -> tuple[list[int], list[bool]]:
        template = self._template(row)
        messages = [dict(m) for m in row.messages]
        try:
            if _marks_generation(template):
                out = self.hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True)
                return list(out["input_ids"]), [bool(x) for x in out["assistant_masks"]]
            text = self.hf.apply_chat_template(messages, tokenize=False)
            spans = []
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                through = self.hf.apply_chat_template(messages[:i + 1], tokenize=False)
                before = self._prompt_before(messages[:i], message, through)
                if not (text.startswith(through) and through.startswith(before)):
                    raise ValueError(
                        f"{row.where}: the chat template of {self.folder} renders a conversation's start "
                        f"differently from the whole (message {i}), so its assistant turns cannot be "
                        "found; mark them in the template with {% generation %} ... {% endgeneration %}")
                spans.append((len(before), len(through)))
        except ValueError:
            raise
        except Exception as err:  # a template that raises (jinja errors, raise_exception)
            raise ValueError(f"{row.where}: the chat template of {self.folder} failed on this row: "
                             f"{type(err).__name__}: {err}") from err
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        # A token overlapping an assistant turn is in the loss (transformers' char_to_token rule:
        # a token that starts before the turn but reaches into it, e.g. " The" after "assistant:").
        in_loss = [any(start < hi and end > lo for lo, hi in spans) for start, end in enc["offset_mapping"]]
        return ids, in_loss


    def _prompt_before(self, messages: list[dict], answer: dict, through: str) -> str:
        """The text before the assistant turn ``answer`` that follows ``messages`` (``through``: their rendering
        with it): their rendering with the generation prompt, the role header the model is given, not asked
        to write.  A conversation that opens with the assistant's turn (a user trial found its header counted
        as the answer's): an empty conversation's generation prompt, or, where the template renders none
        (transformers refuses an empty conversation), ``through`` less the turn as it renders after a user's
        message; nothing before it where neither is found."""
        render = self.hf.apply_chat_template
        if messages:
            return render(messages, tokenize=False, add_generation_prompt=True)
        try:
            return render([], tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - "Cannot apply chat template to an empty conversation"
            pass
        asked = [{"role": "user", "content": "."}]
        prompt, whole = render(asked, tokenize=False, add_generation_prompt=True), render(asked + [answer], tokenize=False)
        turn = whole[len(prompt):]
        if whole.startswith(prompt) and turn and through.endswith(turn):
            return through[:len(through) - len(turn)]
        return ""


def _marks_generation(template: str) -> bool:
    import re

    return re.search(r"{%-?\s*generation\s*-?%}", template) is not None


@dataclass(frozen=True)
class Example:
    ids: np.ndarray      # int64 [n]
    in_loss: np.ndarray  # bool [n]: token k is a label in the loss (k >= 1)


def examples(rows: list[Row], encoder: Encoder, seq_length: int, truncate: bool) -> tuple[list[Example], list[str]]:
    """Each row's tokens; a row longer than ``seq_length + 1`` tokens refused (or cut with ``truncate``).

    A cut row that keeps none of its answer tokens has nothing to learn from: it is left out and named
    (the second value: ``"row 3 (data.jsonl line 3)"``), and all of them left out is refused.  Kept, each
    step made only of such rows reported a NaN loss and still took its optimizer step (user trial).
    """
    out, empty = [], []
    for number, row in enumerate(rows, start=1):
        ids, in_loss = encoder.encode(row)
        if len(ids) - 1 > seq_length:
            if not truncate:
                raise ValueError(
                    f"row {number} ({row.where}) has {len(ids)} tokens; a sequence of seq_length={seq_length} "
                    f"holds at most {seq_length + 1} (inputs and the last label): shorten the row, build the "
                    "model with a larger seq_length, or pass truncate=True to cut such rows")
            ids, in_loss = ids[:seq_length + 1], in_loss[:seq_length + 1]
            if not any(in_loss[1:]):
                empty.append(f"row {number} ({row.where})")
                continue
        out.append(Example(np.asarray(ids, dtype=np.int64), np.asarray(in_loss, dtype=bool)))
    if not out:
        raise ValueError(f"truncate=True cut every row to seq_length={seq_length} tokens before its answer "
                         f"began ({', '.join(empty[:3])}{', ...' if len(empty) > 3 else ''}): nothing is left to "
                         "learn from; build the model with a larger seq_length or shorten the prompts")
    return out, empty


# -- sequences ------------------------------------------------------------------------


def pack(lengths: list[int], seq_length: int, packed: bool) -> list[list[int]]:
    """Example indices per sequence: in order, a new sequence when the next does not fit (or always)."""
    sequences: list[list[int]] = []
    fill = seq_length
    for index, n in enumerate(lengths):
        used = n - 1
        if not packed or fill + used > seq_length:
            sequences.append([])
            fill = 0
        sequences[-1].append(index)
        fill += used
    return sequences


class InstructionSamples:
    """Sequences of examples as Megatron-style samples: ``tokens``, ``labels``, ``loss_mask``,
    ``position_ids`` (torch, ``[seq_length]``) and, packed, ``segment_ids``.

    ``len()`` is the number of sequences; ``fill`` the share of positions holding example tokens
    (packing efficiency); ``examples`` the number of examples.
    """

    def __init__(self, items: list[Example], seq_length: int, *, packed: bool, pad_id: int, seed: int,
                 shuffle: bool = True) -> None:
        order = np.random.default_rng(seed).permutation(len(items)) if shuffle else np.arange(len(items))
        self.items = [items[i] for i in order]
        self.seq_length = seq_length
        self.packed = packed
        self.pad_id = pad_id
        self.sequences = pack([len(e.ids) for e in self.items], seq_length, packed)
        used = sum(len(e.ids) - 1 for e in self.items)
        self.examples = len(self.items)
        self.fill = used / (len(self.sequences) * seq_length)
        self.loss_tokens = int(sum(int(e.in_loss[1:].sum()) for e in self.items))

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict:
        import torch

        s = self.seq_length
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        positions = np.zeros(s, dtype=np.int64)
        segments = np.zeros(s, dtype=np.int64)
        at = 0
        for segment, k in enumerate(self.sequences[int(index)], start=1):
            example = self.items[k]
            n = len(example.ids) - 1
            tokens[at:at + n] = example.ids[:-1]
            labels[at:at + n] = example.ids[1:]
            loss_mask[at:at + n] = example.in_loss[1:]
            positions[at:at + n] = np.arange(n)
            segments[at:at + n] = segment
            at += n
        positions[at:] = np.arange(s - at)  # padding: a segment (0) of its own, never in the loss
        item = {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
                "loss_mask": torch.from_numpy(loss_mask), "position_ids": torch.from_numpy(positions)}
        if self.packed:
            item["segment_ids"] = torch.from_numpy(segments)
        return item

    def summary(self) -> dict:
        """What ``mnb.last_run.packing`` reports."""
        return {"examples": self.examples, "sequences": len(self), "packed": self.packed,
                "fill": round(self.fill, 6), "loss_tokens": self.loss_tokens}


def attention_mask(segment_ids):
    """Megatron's boolean mask ``[b, 1, s, s]`` (True = hidden) from ``segment_ids [b, s]``:
    each token sees the tokens of its own segment up to itself."""
    import torch

    s = segment_ids.shape[-1]
    same = segment_ids.unsqueeze(-1) == segment_ids.unsqueeze(-2)
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    return ~(same & causal).unsqueeze(1)


# -- the entry point -------------------------------------------------------------------

_said: set = set()
_cache: dict = {}
CACHED_SETS = 4
"""Tokenized data sets kept per rank process (training's and evaluation's, a few more)."""


def can_pack(model) -> tuple[bool, str]:
    """Whether this layout isolates packed examples, and why not."""
    from mnb.megatron.spec import have_te

    if model.parallel.cp > 1:
        return False, (f"cp={model.parallel.cp}: the local spec's context-parallel attention takes no "
                       "per-example mask")
    if have_te():
        return False, "Transformer Engine's attention is built causal here, without a per-example mask"
    return True, ""


def samples(model, files: list[Path], seed: int, *, pack: bool = True, truncate: bool = False,
            shuffle: bool = True) -> InstructionSamples:
    """The instruction samples of ``files`` for ``model`` (its tokenizer, seq_length and layout).

    ``pack``: several examples per sequence where the layout can isolate them (see
    :func:`can_pack`; otherwise one per sequence, said once).  Rows and tokens are cached per
    content, tokenizer and length, so a second evaluation does not tokenize again.
    """
    seq_length = model.config.seq_length
    packed = bool(pack)
    if packed:
        packed, why = can_pack(model)
        if not packed:
            _say_once(f"mnb: instruction data is padded, one example per sequence, not packed ({why})")
    tokenizer = getattr(model, "tokenizer", None)
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path).encode())
        digest.update(Path(path).read_bytes())
    key = (digest.hexdigest(), str(getattr(tokenizer, "unique_identifiers", "bytes")), seq_length, bool(truncate))
    items = _cache.get(key)
    if items is None:
        encoder = Encoder(tokenizer)
        items, empty = examples(read_rows(files), encoder, seq_length, truncate)
        if empty:
            _say_once(f"mnb: {len(empty)} row(s) of {files[0].name if len(files) == 1 else 'the data'} kept no "
                      f"answer token once truncate=True cut them to seq_length={seq_length} tokens, and are left out: "
                      f"{', '.join(empty[:3])}{', ...' if len(empty) > 3 else ''}")
        top = max(int(e.ids.max()) for e in items)
        if top >= model.config.vocab_size:
            raise ValueError(f"instruction data {files[0]} has token ids up to {top} but the model's "
                             f"vocab_size is {model.config.vocab_size}; build the model with the "
                             "tokenizer's vocabulary")
        while len(_cache) >= CACHED_SETS:  # the oldest goes: training's and evaluation's sets stay
            _cache.pop(next(iter(_cache)))
        _cache[key] = items = (items, encoder.eos)
    items, eos = items
    return InstructionSamples(items, seq_length, packed=packed, pad_id=eos, seed=seed, shuffle=shuffle)


def _say_once(line: str) -> None:
    """``line`` on rank 0, once per process (every rank computes it alike)."""
    if line in _said:
        return
    _said.add(line)
    import torch

    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(line, flush=True)


def check(model, data, *, truncate: bool = False) -> None:
    """Read, check and tokenize ``data`` if it is instruction data (cached for :func:`samples`):
    ``mnb.train`` calls it first, so a bad row is refused before any rank starts a collective."""
    files = files_of(data)
    if files is not None:
        samples(model, files, 0, pack=False, truncate=truncate, shuffle=False)
