"""A byte-level tokenizer that needs no download, shaped like a Megatron tokenizer.

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

from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np
from megatron.core.tokenizers import MegatronTokenizerBase

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
