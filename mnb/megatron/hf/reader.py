"""A Hugging Face safetensors checkpoint: its headers, and where each slice of a tensor lies on disk.

Opening checks what every rank can check alike from file headers alone (no tensor data):
the weights exist, every shard the index names exists, and every tensor the model needs is
there with the shape ``config.json`` implies.  So bad input fails on every rank with the
same message, before any rank reads a byte of weights or enters a collective.

The headers are parsed here (the documented format: an 8-byte little-endian header length,
then that many bytes of JSON mapping each tensor to its ``dtype``, ``shape`` and ``data_offsets``
relative to the end of the header), so a slice of a tensor is a byte range of a file:
:meth:`Checkpoint.span` turns rows ``[a, b)`` of a row-major tensor into one contiguous
:class:`Span`, columns ``[a, b)`` into one strided span (a segment per row).  Reading them is
:mod:`.stream`'s job.  Parsing a 255-tensor header took 11 ms on the (loaded) CPU machine against
4 ms for ``safe_open`` with every shape asked; both are small beside the reads (0.1-0.2 s for a
3B model on one H200), and safetensors' API gives no byte offsets.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20
"""safetensors' own limit on the JSON header."""

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
ELEMENT_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of one shard: its dtype on disk, shape and absolute byte range in the file."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]


@dataclass(frozen=True)
class Span:
    """``count`` segments of ``length`` bytes of shard ``file``, ``stride`` bytes apart, from ``offset``
    (``count == 1``: one contiguous range)."""

    file: str
    offset: int
    length: int
    count: int = 1
    stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.length * self.count

    def ranges(self) -> list[tuple[int, int]]:
        """Each segment's ``(start, stop)`` byte offsets in the file."""
        return [(self.offset + i * self.stride, self.offset + i * self.stride + self.length)
                for i in range(self.count)]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of the safetensors file ``path``; ValueError naming the file if it is not one."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{path} is not a readable safetensors file ({why}); re-save or re-download it")

    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little")
            text = f.read(n) if len(head) == 8 and n <= min(size - 8, MAX_HEADER_BYTES) else None
    except OSError as exc:
        raise bad(repr(exc)) from None
    if text is None:
        raise bad(f"{size} bytes, header length {n}: not a safetensors header")
    try:
        meta = json.loads(text)
    except ValueError as exc:  # UnicodeDecodeError too
        raise bad(f"header is not JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise bad("header is not a JSON object")
    start = 8 + n
    out = {}
    for name, entry in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name} lacks dtype, shape or data_offsets") from None
        if dtype not in DTYPES:
            raise bad(f"tensor {name} has dtype {dtype}, which mnb.from_hf does not read")
        info = TensorInfo(path.name, dtype, shape, start + int(a), start + int(b))
        if info.end - info.begin != math.prod(shape) * info.element_bytes or info.end > size or a < 0:
            raise bad(f"tensor {name}'s data_offsets {[a, b]} do not hold {dtype} {list(shape)} inside the file")
        out[name] = info
    return out


class Checkpoint:
    """The safetensors files of one folder, by their headers (no tensor data read)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX
        if (self.folder / SINGLE).is_file():  # before an index, as transformers reads a folder holding both
            files = [SINGLE]
            weight_map = None
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{index} is not a safetensors index with a weight_map ({exc!r}); "
                                 "fix or replace it") from None
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.folder / f).is_file()]
            if missing:
                raise ValueError(f"{index} names shard {missing[0]}, which is missing from {self.folder}"
                                 + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                                 + "; copy the whole checkpoint folder")
        else:
            others = sorted(p.name for p in self.folder.glob("*.bin")) + sorted(p.name for p in self.folder.glob("*.pt"))
            hint = (f"; it has {', '.join(others[:3])}: save it as safetensors (transformers' "
                    "save_pretrained(..., safe_serialization=True))") if others else ""
            raise ValueError(f"{self.folder} holds no weights: neither {SINGLE} nor {INDEX}{hint}")
        self.files = files
        self.tensors: dict[str, TensorInfo] = {}
        for name in files:
            self.tensors.update(read_header(self.folder / name))
        if weight_map is not None:
            for key, name in weight_map.items():
                info = self.tensors.get(key)
                if info is None or info.file != name:
                    raise ValueError(f"{index} places {key} in {name}, but {self.folder / name} does not hold it")

    def dtype(self) -> str:
        """The dtype of the first tensor on disk (``BF16``, ``F16``, ``F32``)."""
        return next(iter(self.tensors.values())).dtype if self.tensors else "F32"

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key].shape

    def check(self, expected: dict[str, tuple[int, ...]], config: str) -> None:
        """ValueError for the first missing tensor or wrong shape, naming the file and ``config.json``."""
        for key, shape in expected.items():
            if key not in self.tensors:
                raise ValueError(f"{self.folder} has no tensor {key}, which {config} implies; the checkpoint "
                                 "does not match its config.json (or is incomplete)")
            got = self.shape(key)
            if got != tuple(shape):
                raise ValueError(f"{self.folder / self.tensors[key].file}: {key} has shape {list(got)}, but "
                                 f"{config} implies {list(shape)}; the weights and config.json disagree")

    def span(self, key: str, dim: int, start: int, stop: int) -> tuple[Span, tuple[int, ...]]:
        """Where rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of ``key`` lie, and their shape.

        Rows of a row-major tensor are one contiguous range; all columns are the whole tensor; fewer
        columns are one segment per row, a row's length apart."""
        info = self.tensors[key]
        el, shape = info.element_bytes, info.shape
        if not 0 <= start <= stop <= shape[dim]:
            raise ValueError(f"{key}: slice [{start}, {stop}) of dim {dim} outside its shape {list(shape)}")
        if dim == 0:
            row = math.prod(shape[1:]) * el
            return (Span(info.file, info.begin + start * row, (stop - start) * row),
                    (stop - start, *shape[1:]))
        if dim != 1 or len(shape) != 2:
            raise ValueError(f"{key}: mnb reads slices of dim 0 or 1 of a matrix, not dim {dim} of {list(shape)}")
        rows, cols = shape
        if start == 0 and stop == cols:
            return Span(info.file, info.begin, info.end - info.begin), shape
        return (Span(info.file, info.begin + start * el, (stop - start) * el, rows, cols * el),
                (rows, stop - start))
