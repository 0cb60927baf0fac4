"""A Hugging Face safetensors checkpoint, read by slices: single file or sharded with an index.

Opening checks what every rank can check alike from file headers alone (no tensor data):
the weights exist, every shard the index names exists, and every tensor the model needs is
there with the shape ``config.json`` implies.  So bad input fails on every rank with the
same message, before any rank reads a byte of weights or enters a collective.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class Checkpoint:
    """The safetensors files of one folder; :meth:`slice` reads rows or columns of one tensor."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
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
        elif (self.folder / SINGLE).is_file():
            files = [SINGLE]
            weight_map = None
        else:
            others = sorted(p.name for p in self.folder.glob("*.bin")) + sorted(p.name for p in self.folder.glob("*.pt"))
            hint = (f"; it has {', '.join(others[:3])}: save it as safetensors (transformers' "
                    "save_pretrained(..., safe_serialization=True))") if others else ""
            raise ValueError(f"{self.folder} holds no weights: neither {SINGLE} nor {INDEX}{hint}")
        self._handles = {}
        for name in files:
            try:
                self._handles[name] = safe_open(str(self.folder / name), framework="pt")
            except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
                raise ValueError(f"{self.folder / name} is not a readable safetensors file ({exc})") from None
        self.where: dict[str, str] = {}
        for name, handle in self._handles.items():
            for key in handle.keys():
                self.where[key] = name
        if weight_map is not None:
            for key, name in weight_map.items():
                if self.where.get(key) != name:
                    raise ValueError(f"{index} places {key} in {name}, but {self.folder / name} does not hold it")

    def dtype(self) -> str:
        """The dtype of the first floating tensor on disk (``BF16``, ``F16``, ``F32``)."""
        for key, name in self.where.items():
            return self._handles[name].get_slice(key).get_dtype()
        return "F32"

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self.where[key]].get_slice(key).get_shape())

    def check(self, expected: dict[str, tuple[int, ...]], config: str) -> None:
        """ValueError for the first missing tensor or wrong shape, naming the file and ``config.json``."""
        for key, shape in expected.items():
            if key not in self.where:
                raise ValueError(f"{self.folder} has no tensor {key}, which {config} implies; the checkpoint "
                                 "does not match its config.json (or is incomplete)")
            got = self.shape(key)
            if got != tuple(shape):
                raise ValueError(f"{self.folder / self.where[key]}: {key} has shape {list(got)}, but {config} "
                                 f"implies {list(shape)}; the weights and config.json disagree")

    def slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of ``key``, only those read from disk."""
        part = self._handles[self.where[key]].get_slice(key)
        return part[start:stop] if dim == 0 else part[:, start:stop]
