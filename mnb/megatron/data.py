"""Training data for mnb ranks: text -> Megatron ``.bin/.idx`` -> ``GPTDataset``.

The training loop calls one function::

    ds = dataset_for("stdlib", model_config, seq_length=64, num_samples=1000, seed=1234)
    ds[0]  # {"tokens", "labels", "loss_mask", "position_ids"}: LongTensor/FloatTensor [seq_length]

``data`` is one of

- ``"mock"``: Megatron's ``MockGPTDataset`` (ids ``1, 2, 3, ... eod``; nothing on disk);
- a corpus preset, see :data:`CORPORA` (``"stdlib"``: Python's own standard library
  sources, a sorted, size-capped subset; present offline on every machine);
- a text file, a folder (every non-hidden, non-binary file below it, sorted; see
  :mod:`mnb.megatron.corpora`), a glob (``"notes/**/*.md"``) or a list of those;
- an existing Megatron ``.bin/.idx`` prefix (``/data/my_text_document``).

Text is tokenized with the model's tokenizer: a Hugging Face checkpoint's own
(:class:`~mnb.megatron.tokenizer.HFTokenizer`, ``model.tokenizer``; each document then starts
with the BOS its post-processor adds, e.g. Llama 3's, and ends with its eos) or, when the model
has none, :class:`~mnb.megatron.tokenizer.ByteTokenizer` (UTF-8 bytes; each document ends with
the eod id 256). One document per file, large files cut at blank lines, into
``$MNB_CACHE/corpora/<name>-<content hash>.{bin,idx}`` (default cache ``~/.cache/mnb``); the
hash covers the files' bytes and the tokenizer's identity (for a checkpoint's tokenizer its
``fingerprint``), so each tokenizer has its own copy. A second call with the same content and
tokenizer finds the finished files and returns at once. A ``.bin/.idx`` prefix that mnb built
with another tokenizer than the model's is refused.

Several ranks at once. ``.bin/.idx`` files are built under an exclusive file lock
(``fcntl.flock`` on ``<prefix>.lock``) and renamed into place when complete, so any
number of processes on one node (or on nodes sharing the cache directory) may call
:func:`dataset_for` together: one builds, the others wait and then read.
Megatron's sample indices are then built by ``BlendedMegatronDatasetBuilder``, whose
own protocol is "global rank 0 builds, barrier, the other ranks load": with
``torch.distributed`` initialised, :func:`dataset_for` is therefore a collective
(call it on every rank), and on several nodes ``$MNB_CACHE`` must be shared storage.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from mnb.config import ModelConfig
from mnb.errors import OverwriteRefusedError
from mnb.megatron.corpora import (  # noqa: F401 - re-exported: data.CORPORA, data.resolve_text_files
    CORPORA,
    Corpus,
    DataSpec,
    cache_dir,
    resolve_text_files,
    stdlib_files,
)
from mnb.megatron.tokenizer import EOD_ID, ByteTokenizer, MockTokenizer
from mnb.units import cwd_note

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Bump to invalidate every cached corpus (part of the content hash)."""
MAX_DOCUMENT_BYTES = 1 << 20
"""Files larger than this are cut into documents at blank lines."""
LOCK_TIMEOUT_S = 1800.0


# -- building .bin/.idx ------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Exclusive ``flock`` on ``path`` (created if missing), polling up to ``timeout_s``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"waited {timeout_s:.0f} s for {path}; another process is building "
                        "this corpus (or died holding the lock: delete the file and retry)"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _content_hash(files: Sequence[Path], tokenizer) -> str:
    """sha256 over format, tokenizer identity and each file's bytes (names excluded)."""
    digest = hashlib.sha256()
    head = {"format": FORMAT_VERSION, "max_doc": MAX_DOCUMENT_BYTES,
            "tokenizer": dict(tokenizer.unique_identifiers)}
    digest.update(json.dumps(head, sort_keys=True).encode())
    for path in files:
        data = Path(path).read_bytes()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def _split_document(data: bytes, max_bytes: int = MAX_DOCUMENT_BYTES) -> list[bytes]:
    """One document, or pieces of at most ``max_bytes`` cut after blank lines."""
    if len(data) <= max_bytes:
        return [data]
    pieces, start = [], 0
    while len(data) - start > max_bytes:
        cut = data.rfind(b"\n\n", start, start + max_bytes)
        end = cut + 2 if cut > start else start + max_bytes
        pieces.append(data[start:end])
        start = end
    pieces.append(data[start:])
    return pieces


ENCODE_BATCH_BYTES = 8 << 20
"""Documents handed together to a tokenizer that encodes batches in parallel (``tokenize_documents``)."""


def _pieces(files: Sequence[Path]) -> Iterator[bytes]:
    for path in files:
        yield from (piece for piece in _split_document(path.read_bytes()) if piece)


def _encoded(tokenizer, files: Sequence[Path]) -> Iterator[np.ndarray]:
    """The ids of each document of ``files``, in order."""
    if hasattr(tokenizer, "tokenize_bytes"):
        for piece in _pieces(files):
            yield tokenizer.tokenize_bytes(piece)
        return
    batch: list[str] = []
    size = 0
    for piece in _pieces(files):
        batch.append(piece.decode("utf-8", errors="replace"))
        size += len(piece)
        if size >= ENCODE_BATCH_BYTES:
            yield from _encode_texts(tokenizer, batch)
            batch, size = [], 0
    yield from _encode_texts(tokenizer, batch)


def _encode_texts(tokenizer, texts: list[str]) -> Iterator[np.ndarray]:
    if not texts:
        return
    many = getattr(tokenizer, "tokenize_documents", None)
    for ids in (many(texts) if many else map(tokenizer.tokenize, texts)):
        yield np.asarray(ids, dtype=np.int64)


def _meta_path(prefix: str) -> Path:
    return Path(prefix + ".mnb.json")


def read_meta(prefix: str) -> dict | None:
    """The sidecar written by :func:`build_indexed_dataset`, or None."""
    try:
        return json.loads(_meta_path(prefix).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _check_own_prefix(prefix: str, overwrite: bool) -> None:
    """Refuse (:class:`~mnb.errors.OverwriteRefusedError`) ``prefix.bin``/``.idx`` that mnb did not build
    (no ``prefix.mnb.json`` beside them), unless ``overwrite``."""
    theirs = [prefix + suffix for suffix in (".bin", ".idx") if os.path.lexists(prefix + suffix)]
    if theirs and not overwrite and not _meta_path(prefix).exists():
        raise OverwriteRefusedError(
            f"the corpus cache: {', '.join(theirs)} exist and mnb did not build them (no {_meta_path(prefix).name} "
            f"beside them); read them as data={prefix!r}, choose another output prefix, or pass overwrite=True "
            "to replace them")


def build_indexed_dataset(text_files: Sequence[str | os.PathLike], output_prefix: str,
                          tokenizer=None, *, overwrite: bool = False) -> str:
    """Tokenize ``text_files`` into Megatron's ``output_prefix.{bin,idx}``; return the prefix.

    One document per file (files over :data:`MAX_DOCUMENT_BYTES` are cut at blank
    lines), each encoded by ``tokenizer.tokenize`` (a checkpoint's tokenizer adds its BOS
    there) and followed by ``tokenizer.eod``. Written through
    ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` into temporary
    files renamed into place, under a file lock; the sidecar ``output_prefix.mnb.json``
    (written last) records the content hash, so a second call with the same content
    returns immediately. Read back with ``IndexedDataset(output_prefix)``.  A ``.bin``/``.idx``
    pair at ``output_prefix`` without that sidecar (not mnb's) is refused unless ``overwrite``.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    tokenizer = tokenizer or ByteTokenizer()
    files = [Path(f) for f in text_files]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} text file(s) not found: {', '.join(missing[:5])}"
                                f"{cwd_note(missing[0])}")
    if not files:
        raise ValueError(f"no text files given for {output_prefix}")
    output_prefix = os.fspath(output_prefix)
    digest = _content_hash(files, tokenizer)
    meta = read_meta(output_prefix)
    if meta and meta.get("sha256") == digest:
        return output_prefix

    with _file_lock(Path(output_prefix + ".lock")):
        meta = read_meta(output_prefix)
        if meta and meta.get("sha256") == digest:  # built by another process meanwhile
            return output_prefix
        _check_own_prefix(output_prefix, overwrite)  # under the lock: every process sees the same files
        t0 = time.perf_counter()
        tmp = f"{output_prefix}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        dtype = DType.optimal_dtype(tokenizer.vocab_size)
        num_docs = num_tokens = max_id = 0
        try:
            builder = IndexedDatasetBuilder(tmp + ".bin", dtype=dtype)
            for ids in _encoded(tokenizer, files):
                doc = np.empty(len(ids) + 1, dtype=np.int64)
                doc[:-1] = ids
                doc[-1] = tokenizer.eod
                builder.add_document(doc, [len(doc)])
                num_docs += 1
                num_tokens += len(doc)
                max_id = max(max_id, int(doc.max()))
            builder.finalize(tmp + ".idx")
            if num_docs == 0:
                raise ValueError(
                    f"corpus for {output_prefix} is empty: {len(files)} file(s), 0 bytes of text"
                )
            # the old sidecar no longer describes the files, but the files stay mnb's until the new one
            _meta_path(output_prefix).write_text(json.dumps({"building": True}))
            os.replace(tmp + ".bin", output_prefix + ".bin")
            os.replace(tmp + ".idx", output_prefix + ".idx")
            meta = {
                "sha256": digest, "format": FORMAT_VERSION, "num_files": len(files),
                "num_documents": num_docs, "num_tokens": num_tokens, "max_token_id": max_id,
                "vocab_size": tokenizer.vocab_size, "tokenizer": dict(tokenizer.unique_identifiers),
                "build_s": round(time.perf_counter() - t0, 3),
            }
            Path(tmp + ".mnb.json").write_text(json.dumps(meta, indent=1))
            os.replace(tmp + ".mnb.json", _meta_path(output_prefix))
        finally:
            for suffix in (".bin", ".idx", ".mnb.json"):
                Path(tmp + suffix).unlink(missing_ok=True)
    logger.info("built %s: %d documents, %d tokens in %.2f s",
                output_prefix, num_docs, num_tokens, meta["build_s"])
    return output_prefix


def _is_prefix(text: str) -> str | None:
    stem = text[:-4] if text.endswith((".bin", ".idx")) else text
    return stem if os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx") else None


def prepare(data: DataSpec, tokenizer=None) -> str:
    """Resolve ``data`` (preset, files, folder, glob or prefix) to a ``.bin/.idx`` prefix."""
    tokenizer = tokenizer or ByteTokenizer()
    if not isinstance(data, (list, tuple)):
        prefix = _is_prefix(os.fspath(data))
        if prefix is not None and os.fspath(data) not in CORPORA:
            _check_prefix_tokenizer(prefix, tokenizer)
            return prefix
    files = resolve_text_files(data)
    if not files or sum(f.stat().st_size for f in files) == 0:
        raise ValueError(f"data {data!r} has no text: {len(files)} file(s), 0 bytes")
    label = "-".join(Path(os.fspath(d)).name or "data" for d in
                     (data if isinstance(data, (list, tuple)) else [data]))[:40]
    label = "".join(c if c.isalnum() or c in "-_." else "_" for c in label) or "data"
    digest = _content_hash(files, tokenizer)
    return build_indexed_dataset(files, str(cache_dir() / "corpora" / f"{label}-{digest[:16]}"),
                                 tokenizer)


def _check_prefix_tokenizer(prefix: str, tokenizer) -> None:
    """Refuse a prefix that mnb built (it has a sidecar) with another tokenizer than ``tokenizer``."""
    built = (read_meta(prefix) or {}).get("tokenizer")
    if built is not None and built != dict(tokenizer.unique_identifiers):
        raise ValueError(
            f"{prefix}.bin was tokenized by mnb with {built.get('class', '?').rsplit('.', 1)[-1]} "
            f"(vocab_size {built.get('vocab_size')}), not with this model's tokenizer {tokenizer!r}; "
            "pass the text files instead, and mnb tokenizes them again with the model's tokenizer"
        )


def max_token_id(prefix: str) -> int:
    """Largest id in ``prefix.bin`` (from the mnb sidecar when there is one)."""
    meta = read_meta(prefix)
    if meta and "max_token_id" in meta:
        return int(meta["max_token_id"])
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dtype = IndexedDataset(prefix).index.dtype
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    if tokens.size == 0:
        raise ValueError(f"Megatron dataset {prefix}.bin holds no tokens")
    return int(tokens.max())


# -- the entry point --------------------------------------------------------------


def dataset_for(data: str, model_config: ModelConfig, seq_length: int, num_samples: int,
                seed: int, *, tokenizer=None, attention_mask: bool = False):
    """A Megatron ``GPTDataset`` of at least ``num_samples`` items of ``seq_length`` tokens.

    Items are dicts of tensors like Megatron's GPTDataset: ``tokens``, ``labels``
    (``tokens`` shifted by one), ``loss_mask``, ``position_ids``, plus
    ``attention_mask`` when ``attention_mask=True`` (Megatron's causal attention
    builds its own mask, so it is off by default). Sampling order is fixed by ``seed``.

    ``tokenizer`` encodes text data (the model's ``tokenizer``; None: the byte tokenizer).
    Collective when ``torch.distributed`` is initialised (Megatron's builder barriers
    on the world group): call it on every rank. Raises FileNotFoundError for a missing
    path, ValueError for an empty corpus or ids that do not fit ``model_config.vocab_size``.

    Example::

        python -c "from mnb.config import model_config; from mnb.megatron.data import dataset_for; \\
                   print(dataset_for('stdlib', model_config('tiny', vocab_size=257), 64, 10, 0)[0])"
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    for name, value in (("seq_length", seq_length), ("num_samples", num_samples)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    vocab = model_config.vocab_size
    common = dict(random_seed=seed, sequence_length=seq_length, reset_position_ids=False,
                  reset_attention_mask=False, eod_mask_loss=False,
                  create_attention_mask=attention_mask)
    if data == "mock":
        config = GPTDatasetConfig(tokenizer=MockTokenizer(vocab), **common)
        # Mock configs force split "1,1,1"; build the train split only.
        config.split_matrix = convert_split_vector_to_split_matrix([1.0, 0.0, 0.0])
        cls = MockGPTDataset
    else:
        if tokenizer is None and vocab < ByteTokenizer().vocab_size and not (
                isinstance(data, (str, os.PathLike)) and _is_prefix(os.fspath(data))):
            raise ValueError(
                f"data {data!r} is text, which mnb's byte tokenizer reads as token ids up to {EOD_ID} "
                f"(the model has no tokenizer of its own), but the model's vocab_size is {vocab}: build "
                f"the model with vocab_size >= {EOD_ID + 1}, give it its own tokenizer (a Hugging Face "
                "checkpoint's tokenizer.json), or pass a .bin/.idx prefix of token ids"
            )
        tokenizer = tokenizer or ByteTokenizer()
        prefix = prepare(data, tokenizer)
        top = max_token_id(prefix)
        if top >= vocab:
            hint = (f"the byte tokenizer, used for a model without a tokenizer of its own, needs "
                    f"{ByteTokenizer().vocab_size}; or give data= a .bin/.idx prefix of ids"
                    if isinstance(tokenizer, ByteTokenizer) else f"its tokenizer: {tokenizer!r}")
            raise ValueError(
                f"data {data!r} has token ids up to {top} but the model's vocab_size is "
                f"{vocab}; build the model with vocab_size >= {top + 1} ({hint})"
            )
        config = GPTDatasetConfig(tokenizer=tokenizer, blend=([prefix], None), split="1,0,0",
                                  path_to_cache=str(cache_dir() / "indices"), **common)
        cls = GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(
        cls, [num_samples, None, None], lambda: True, config
    ).build()
    return train
