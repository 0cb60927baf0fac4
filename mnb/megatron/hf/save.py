"""``mnb.save_hf(path, model)``: a Hugging Face folder from a model under any layout; collective.

Inside a ``%%megatron`` cell, on every rank::

    model = mnb.from_hf("/models/Llama-3.2-1B")
    mnb.train(model, steps=100, data="notes/")
    mnb.save_hf("/models/llama-notes", model)   # transformers' from_pretrained loads it

Each tensor is assembled once: the tensor-parallel ranks of one data-parallel replica gather it to
their first rank, which writes it; every pipeline stage and every expert-parallel rank writes its
own shards (at most ``max_shard_bytes`` each), so no rank holds the whole model.  Ranks write into
``<path>.tmp-<id>``; after every rank finished, rank 0 names the shards
``model-0000i-of-0000n.safetensors``, writes ``model.safetensors.index.json``, ``config.json``
(the source's with the overrides applied, or one written from the ``ModelConfig`` of an
``mnb.gpt`` model of a supported architecture) and the source's tokenizer files, and renames the
folder into place, as :func:`mnb.save` does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from mnb import writes
from mnb.hf_config import to_hf_config
from mnb.megatron.hf.load import canonical_names, family_tensors, heads_of, tp_coords
from mnb.megatron.hf.rules import hf_pieces

logger = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 * 10**9
"""Hugging Face's default largest shard (5 GB)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "vocab.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")
"""Files copied from the source folder beside the weights when present."""

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
           "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _dtype(model, dtype) -> torch.dtype:
    """The dtype to write: as asked; else bf16 for a model trained in bf16, the source's dtype on disk, fp32."""
    if dtype is None:
        if getattr(model, "precision", None) == "bf16":
            return torch.bfloat16
        source = getattr(model, "hf", None)
        return _DTYPES.get(source.dtype, torch.float32) if source is not None else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in _DTYPE_NAMES:
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32 (or their names), got {dtype!r}")


def hf_config_dict(model, dtype: torch.dtype) -> tuple[str, dict]:
    """(architecture, config.json contents) for ``model``: the source's config with mnb's settings applied."""
    cfg = model.config
    fresh = to_hf_config(cfg)
    if model.hf is None:
        out = fresh
    else:  # the source's settings, its architecture name (Mistral stays Mistral) and its extras kept
        out = dict(model.hf.config)
        for key, value in fresh.items():
            if key in ("architectures", "model_type", "attention_dropout") or key.endswith("pdrop"):
                continue
            if key in ("rope_theta", "rope_scaling") and "rope_parameters" in out:
                continue
            out[key] = value
        if isinstance(out.get("rope_parameters"), dict):
            out["rope_parameters"] = {**out["rope_parameters"], "rope_theta": cfg.rotary_base}
    out["dtype"] = _DTYPE_NAMES[dtype]
    if "torch_dtype" in out:
        out["torch_dtype"] = _DTYPE_NAMES[dtype]
    from mnb.hf_config import architecture

    return architecture(out, "config.json"), out


def _broadcast(obj):
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


class _Shards:
    """This rank's tensors, flushed into ``part-r<rank>-<k>.safetensors`` files of at most ``limit`` bytes."""

    def __init__(self, folder: Path, rank: int, limit: int) -> None:
        self.folder, self.rank, self.limit = folder, rank, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, dict[str, int]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self.flush()
        self.pending[name] = tensor.detach().cpu().contiguous()
        self.pending_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        name = f"part-r{self.rank:05d}-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.files.append((name, {k: t.numel() * t.element_size() for k, t in self.pending.items()}))
        self.pending, self.pending_bytes = {}, 0


def _writes(rule) -> bool:
    """Whether this rank's tensor-parallel group writes ``rule``'s tensors (one replica of each)."""
    from megatron.core import parallel_state as ps

    if rule.expert:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0


def _gather(local: torch.Tensor, rule) -> list[torch.Tensor]:
    """Every tp rank's local tensor of ``rule``, in rank order (only this one when not split)."""
    from megatron.core import parallel_state as ps

    tp, _ = tp_coords(rule)
    if tp == 1 or rule.kind == "full":
        return [local]
    group = ps.get_expert_tensor_parallel_group() if rule.expert else ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return parts


@torch.no_grad()
def _write_local(model, rules, dtype: torch.dtype, shards: _Shards) -> None:
    from mnb.megatron import lora

    cfg, heads = model.config, heads_of(model.config)
    merged = lora.merged_weights(model)  # adapters folded into their weights (mnb.lora)
    written: set[str] = set()
    for chunk in model.chunks:
        for (name, param), canon in zip(chunk.named_parameters(), canonical_names(chunk).values()):
            if lora.is_adapter_parameter(name):
                continue
            rule = rules.get(canon)
            if rule is None:
                raise ValueError(f"mnb.save_hf has no Hugging Face name for the Megatron parameter {canon}")
            if canon == "output_layer.weight" and cfg.share_embeddings_and_output_weights:
                continue  # tied: the embedding (first stage) is the one copy
            if not _writes(rule):
                continue
            parts = _gather(merged.get(id(param), param.detach().float()), rule)
            _, tp_rank = tp_coords(rule)
            if tp_rank != 0:
                continue
            for hf_name, tensor in hf_pieces(rule, parts, cfg.vocab_size, heads).items():
                if hf_name not in written:
                    written.add(hf_name)
                    shards.add(hf_name, tensor.to(dtype))
    shards.flush()


def save_hf(path: str | os.PathLike, model, *, dtype=None, max_shard_bytes: int = MAX_SHARD_BYTES,
            overwrite: bool = False) -> Path:
    """Write ``model`` (any layout) as a Hugging Face checkpoint folder at ``path``; returns its absolute path.

    ``dtype``: the weights' dtype on disk (default: bf16 for a model trained in bf16, else the
    source checkpoint's, else fp32).  ``max_shard_bytes``: the largest safetensors shard.
    Collective: every rank of the pool calls it.  A model with LoRA adapters (:func:`mnb.lora`) is
    written with them merged into its weights (the model keeps its adapters).  ValueError for a model no supported
    architecture describes (e.g. an ``mnb.gpt`` model with LayerNorm and SwiGLU).

    ``path`` may be new, empty or a Hugging Face checkpoint (replaced once the new one is
    complete, :mod:`mnb.writes`); a folder holding anything else is refused
    (:class:`~mnb.errors.OverwriteRefusedError`, the same on every rank, before anything is
    written) unless ``overwrite=True``.  Either way, entries that are not the checkpoint's own
    files (a ``notes.txt``, a ``sub/``) stay.  A save that stopped between its two renames is
    finished by the next ``save_hf`` to ``path``; ``mnb.from_hf`` reads it meanwhile.
    """
    import torch.distributed as dist

    model.check_layout()
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    dtype = _dtype(model, dtype)
    arch, config = hf_config_dict(model, dtype)
    rules = family_tensors(arch, model.config)
    path = Path(path).expanduser().absolute()
    rank = dist.get_rank()
    t0 = time.perf_counter()
    prepared = writes.prepare(path, writes.HF_CHECKPOINT, overwrite=overwrite, writer="mnb.save_hf") \
        if rank == 0 else None
    plan = writes.agree(_broadcast(prepared))  # the same on every rank, before anything is written
    tmp = plan.tmp
    shards = _Shards(tmp, rank, max_shard_bytes)
    error = None
    try:
        _write_local(model, rules, dtype, shards)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before the next collective
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (error, shards.files))
    errors = [e for e, _ in reports if e]
    if not errors and rank == 0:
        try:
            _finish(plan, [f for _, files in reports for f in files], config, model)
        except Exception as exc:  # noqa: BLE001
            errors = [f"rank 0: {type(exc).__name__}: {exc}"]
    errors = _broadcast(errors)
    if errors:
        if rank == 0:
            writes.discard(plan)
        raise RuntimeError(f"mnb.save_hf({str(path)!r}) failed, nothing was written: {errors[0]}")
    logger.info("save_hf %s in %.2f s", path, time.perf_counter() - t0)
    return path


def _finish(plan: writes.Plan, files: list[tuple[str, dict[str, int]]], config: dict, model) -> None:
    """Rank 0, after every rank wrote: name the shards, the index, config.json, tokenizer files; put in place."""
    tmp = plan.tmp
    count = len(files)
    weight_map, total = {}, 0
    for i, (name, sizes) in enumerate(files):
        final = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        os.replace(tmp / name, tmp / final)
        for key, size in sizes.items():
            weight_map[key] = final
            total += size
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    source = getattr(model, "hf", None)
    if source is not None:
        names = set(TOKENIZER_FILES) | {Path(f).name for f in getattr(model.tokenizer, "files", None) or ()}
        for name in sorted(names):
            if (Path(source.folder) / name).is_file():
                shutil.copy2(Path(source.folder) / name, tmp / name)
    (tmp / "config.json.part").write_text(json.dumps(config, indent=2, sort_keys=True))
    os.replace(tmp / "config.json.part", tmp / "config.json")  # last: the folder is complete
    writes.finish(plan, writes.HF_CHECKPOINT)
