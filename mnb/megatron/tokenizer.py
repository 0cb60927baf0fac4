"""Tokenizers shaped like Megatron's: mnb's byte tokenizer, and a checkpoint's own.

:class:`ByteTokenizer` needs no download and no files; :func:`load_hf_tokenizer` reads a
Hugging Face checkpoint folder's ``tokenizer.json`` (:class:`HFTokenizer`).

Ids 0..255 are the bytes of the UTF-8 text, id 256 is the end-of-document
token; the vocabulary has 257 entries (the model pads its embedding to a
multiple of 128 * tp itself)::

    >>> tok = ByteTokenizer()
    >>> tok.tokenize("hé")
    [104, 195, 169]
    >>> tok.detokenize([104, 195, 169, tok.eod])
    'hé'

What Megatron-Core 0.16 reads from a tokenizer, and where:

- ``vocab_size``: ``GPTDatasetConfig.__post_init__`` (token dtype code),
  ``MockGPTLowLevelDataset`` (range of the mock ids).
- ``eod``: ``GPTDataset.__getitem__`` (masks / position ids),
  ``MockGPTLowLevelDataset``, the inference text-generation controller.
- ``pad``: ``MegatronDataset.__init__`` (falls back to -1 if it raises);
  ``eos`` / ``special_tokens_dict``: the pad-collision check beside it.
- ``unique_identifiers``: ``MegatronDataset`` serialises the config, tokenizer
  included, to JSON for its index-cache hash (``default=obj.unique_identifiers``).
- ``tokenize`` / ``detokenize`` / ``bos`` / ``offsets``: inference only.

The class derives from ``megatron.core.tokenizers.MegatronTokenizerBase`` so
``isinstance`` checks hold; it is built directly, never through
``MegatronTokenizer.from_pretrained`` (whose null-tokenizer library is named
``"null"`` in 0.16 and ``"null-text"`` in 0.19), so it works the same in both.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from megatron.core.tokenizers import MegatronTokenizerBase

from mnb.units import cwd_note

NUM_BYTES = 256
EOD_ID = 256
NO_TOKEN = -1
"""Megatron's 'no such token' value (megatron_dataset._PAD_TOKEN_ID): never a real id."""


class _IdTokenizer(MegatronTokenizerBase):
    """Shared Megatron-facing surface: vocab_size, eod, pad, unique_identifiers."""

    library = "mnb"

    def __init__(self, vocab_size: int, eod: int) -> None:
        super().__init__(path="", config={})
        if not 0 <= eod < vocab_size:
            raise ValueError(f"eod id {eod} must lie in [0, vocab_size={vocab_size})")
        self._vocab_size = int(vocab_size)
        self._eod = int(eod)

    # -- what the datasets read -------------------------------------------------
    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        """No pad token: -1, Megatron's own 'none'; padded positions get loss_mask 0."""
        return NO_TOKEN

    @property
    def bos(self) -> int:
        return NO_TOKEN

    @property
    def special_tokens_dict(self) -> dict[str, int]:
        return {"eod_token": self._eod}

    @property
    def unique_identifiers(self) -> OrderedDict:
        """Identity used in Megatron's dataset-cache hash and in mnb's corpus hash."""
        return OrderedDict(
            {
                "class": f"{type(self).__module__}.{type(self).__qualname__}",
                "vocab_size": self._vocab_size,
                "eod": self._eod,
            }
        )

    def vocab(self):  # type: ignore[override]
        raise NotImplementedError(f"{type(self).__name__} has no string vocabulary")

    def apply_chat_template(self, *args, **kwargs):  # type: ignore[override]
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self._vocab_size}, eod={self._eod})"


class ByteTokenizer(_IdTokenizer):
    """UTF-8 bytes as ids 0..255 plus end-of-document id 256 (vocab size 257)."""

    def __init__(self) -> None:
        super().__init__(vocab_size=NUM_BYTES + 1, eod=EOD_ID)

    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]
        return list(text.encode("utf-8"))

    def tokenize_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes to ids without decoding (any byte sequence is valid)."""
        return np.frombuffer(data, dtype=np.uint8)

    def detokenize(self, ids: Iterable[int]) -> str:  # type: ignore[override]
        """Bytes back to text; special ids are dropped, invalid UTF-8 is replaced."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES)
        return data.decode("utf-8", errors="replace")

    def offsets(self, ids: Sequence[int], text: str) -> list[int]:
        """Character offset of each id in ``text`` (continuation bytes share their char's)."""
        offsets, started = [], 0
        for token in ids:
            if 0 <= token < NUM_BYTES and (token & 0xC0) == 0x80 and started:
                offsets.append(started - 1)
            else:
                offsets.append(started)
                started += 0 <= token < NUM_BYTES
        return offsets


class MockTokenizer(_IdTokenizer):
    """Ids 0..vocab_size-1 with eod = vocab_size - 1, for Megatron's MockGPTDataset.

    Mock samples are ``(arange(n) + 1) % vocab_size`` followed by ``eod``, so every
    id stays inside a model vocabulary of ``vocab_size``.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size=vocab_size, eod=vocab_size - 1)

    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Iterable[int]) -> str:  # type: ignore[override]
        return " ".join(str(int(i)) for i in ids)


# -- a Hugging Face checkpoint's own tokenizer --------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")
"""The files of a Hugging Face tokenizer (those present are :attr:`HFTokenizer.files`)."""
_SPECIALS = ("bos", "eos", "pad")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); repair or remove it") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a {type(value).__name__}, expected a JSON object")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HFTokenizer(_IdTokenizer):
    """A Hugging Face checkpoint's tokenizer (``tokenizer.json``), as a Megatron tokenizer.

    Encodes like ``transformers.AutoTokenizer.from_pretrained(folder)(text).input_ids``
    (special tokens included): the post-processor of ``tokenizer.json`` adds what the model
    expects (Llama 3 a BOS, GPT-2 nothing). ``add_bos_token``/``add_eos_token`` in
    ``tokenizer_config.json`` are ignored beside a ``tokenizer.json``, as transformers 5 ignores
    them (its ``from_pretrained`` drops them; 4.x re-templated Llama tokenizers). Special tokens
    come from ``tokenizer_config.json``, then ``special_tokens_map.json``, then ``config.json``'s
    ``*_token_id`` (the first of a list). ``eod`` is the end-of-sequence token, which mnb's
    corpora put after every document. Only the ``tokenizers`` library is used: no hub call, no
    ``transformers``.

    Attributes beyond Megatron's: ``folder``; ``files`` (the tokenizer files present, which
    ``mnb.save_hf`` copies); ``fingerprint`` (sha256 over the tokenizer files' bytes and the
    resolved special tokens: the same tokenizer in another folder has the same one; corpus
    caches key on it); ``add_bos`` / ``add_eos`` (what :meth:`tokenize` adds).
    """

    library = "huggingface"

    def __init__(self, folder: str | Path) -> None:
        from tokenizers import Tokenizer

        self.folder = Path(folder).expanduser()
        path = self.folder / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as err:  # noqa: BLE001 - the library raises plain Exception
            raise ValueError(f"cannot read {path} with the tokenizers library: {err}") from None
        config = _read_json(self.folder / "tokenizer_config.json")
        specials = _read_json(self.folder / "special_tokens_map.json")
        model = _read_json(self.folder / "config.json")
        vocab = self._tok.get_vocab(with_added_tokens=True)
        ids = {name: self._special_id(name, config, specials, model) for name in _SPECIALS}
        if ids["eos"] is None:
            raise ValueError(
                f"{self.folder} names no end-of-sequence token (eos_token in tokenizer_config.json "
                "or special_tokens_map.json, eos_token_id in config.json): mnb ends every document "
                "with it; add one of those"
            )
        super().__init__(vocab_size=max(vocab.values()) + 1, eod=ids["eos"])
        self._bos, self._pad = ids["bos"], ids["pad"]
        probe = self._tok.encode("a")
        self.add_bos = self._bos is not None and probe.ids[:1] == [self._bos]
        self.add_eos = probe.ids[-1:] == [self._eod] and probe.special_tokens_mask[-1] == 1
        self.files = [self.folder / name for name in TOKENIZER_FILES if (self.folder / name).is_file()]
        self.fingerprint = self._fingerprint()

    def _special_id(self, name: str, config: dict, specials: dict, model: dict) -> int | None:
        """The id of ``bos``/``eos``/``pad``, or None when the folder names none."""
        key = f"{name}_token"
        for source, found in (("tokenizer_config.json", config), ("special_tokens_map.json", specials)):
            text = _token_text(found.get(key))
            if text is not None:
                token = self._tok.token_to_id(text)
                if token is None:
                    raise ValueError(f"{key} {text!r} in {self.folder / source} is not in the "
                                     "vocabulary of tokenizer.json; correct one of the two")
                return token
        value = model.get(f"{name}_token_id")
        if isinstance(value, list):
            value = value[0] if value else None
        return value if isinstance(value, int) and value >= 0 else None

    def _fingerprint(self) -> str:
        digest = hashlib.sha256()
        for path in self.files:
            data = path.read_bytes()
            digest.update(f"{path.name}:{len(data)}:".encode())
            digest.update(data)
        resolved = [self._bos, self._eod, self._pad, self.add_bos, self.add_eos, self._vocab_size]
        digest.update(json.dumps(resolved).encode())
        return digest.hexdigest()

    # -- Megatron's tokenizer surface ----------------------------------------------------
    def tokenize(self, text: str) -> list[int]:  # type: ignore[override]
        """Ids as the model was trained on them (the BOS/EOS its post-processor adds included)."""
        return self._tok.encode(text).ids

    def tokenize_documents(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`tokenize` of each text, in parallel threads of the tokenizers library."""
        return [enc.ids for enc in self._tok.encode_batch(list(texts))]

    def detokenize(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:  # type: ignore[override]
        """Text of ``ids``; special tokens (BOS, EOS, ...) dropped unless ``skip_special_tokens=False``."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def offsets(self, ids: Sequence[int], text: str) -> list[int]:
        """Character offset in ``text`` where each id starts (``text`` = ``detokenize(ids)``)."""
        encoding = self._tok.encode(text)
        if encoding.ids == [int(i) for i in ids]:
            return [start for start, _ in encoding.offsets]
        return [len(self.detokenize(ids[:i])) for i in range(len(ids))]

    @property
    def bos(self) -> int:
        return NO_TOKEN if self._bos is None else self._bos

    @property
    def pad(self) -> int:
        """The folder's pad token, or -1 (Megatron's 'none': its datasets then mask nothing)."""
        return NO_TOKEN if self._pad is None else self._pad

    @property
    def special_tokens_dict(self) -> dict[str, int]:
        """Megatron's datasets check that ``pad`` collides with none of these."""
        named = {"eod_token": self._eod, "eos_token": self._eod, "bos_token": self._bos,
                 "pad_token": self._pad}
        return {key: value for key, value in named.items() if value is not None}

    @property
    def unique_identifiers(self) -> OrderedDict:
        ids = super().unique_identifiers
        ids["fingerprint"] = self.fingerprint
        return ids

    def vocab(self) -> dict[str, int]:  # type: ignore[override]
        """Token text to id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return (f"HFTokenizer({str(self.folder)!r}, vocab_size={self._vocab_size}, eod={self._eod}, "
                f"bos={self.bos}, add_bos={self.add_bos})")


def load_hf_tokenizer(folder: str | Path) -> HFTokenizer | None:
    """The tokenizer of a Hugging Face checkpoint folder, or None when it has no ``tokenizer.json``.

    Offline (``tokenizers`` only; never the hub)::

        tok = load_hf_tokenizer("/ckpt/Llama-3.2-1B")
        tok.tokenize("Hello")     # [128000, 9906]: Llama 3 adds its BOS
        tok.detokenize(tok.tokenize("Hello"))   # 'Hello'

    A folder that is not a directory raises FileNotFoundError; an unreadable or inconsistent
    ``tokenizer.json``/``tokenizer_config.json`` raises ValueError naming the file.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a folder{cwd_note(path)}: pass a Hugging Face checkpoint folder")
    if not (path / "tokenizer.json").is_file():
        return None
    return HFTokenizer(path)
