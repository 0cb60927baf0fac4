"""``mnb.from_hf(path, **overrides)``: this rank's part of a Hugging Face checkpoint, for the current layout.

Inside a ``%%megatron --tp 2 --pp 2`` cell::

    model = mnb.from_hf("/models/Llama-3.2-1B")                     # every layout mnb.gpt takes
    model = mnb.from_hf("/models/Llama-3.2-1B", num_layers=4, seq_length=512)
    mnb.train(model, steps=3, data="notes/")                        # its own tokenizer (model.tokenizer)

Steps, the same on every rank: ``config.json`` -> :class:`ModelConfig` (:func:`mnb.hf_config`),
the layout checked against it, the safetensors headers checked against the config (every
tensor there, every shape right, every shard of the index present), the chunks built without
initialising their weights, then each parameter filled from only the rows or columns this rank
holds: first asked of meta tensors (which slices, every shape checked), then read in one pass
over the shards, each byte range once, in large reads, staged on the rank's device through a few
pinned buffers (:mod:`.stream`).  Nothing reads the whole model on one rank, and nothing holds a
host copy of it.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mnb import writes
from mnb.hf_config import architecture, config_path, hf_config, read_config
from mnb.megatron.hf.reader import DTYPES, Checkpoint
from mnb.megatron.hf.stream import OnePass, ReadLog
from mnb.megatron.hf.rules import Heads, Rule, read_local
from mnb.megatron.tokenizer import load_hf_tokenizer

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 5.0
"""A progress line from global rank 0 at most this often during a load."""


@dataclass(frozen=True)
class Source:
    """Where a model came from: :func:`mnb.save_hf` copies its config.json and tokenizer files."""

    folder: str
    config: dict
    """The source's ``config.json``."""
    dtype: str
    """Dtype of its weights on disk (``BF16``, ``F16``, ``F32``)."""
    read: ReadLog | None = None
    """What this rank read and staged (:class:`~mnb.megatron.hf.stream.ReadLog`): its byte ranges, once each."""


def family_tensors(arch: str, cfg) -> dict[str, Rule]:
    """Every Megatron parameter of the whole model -> its :class:`Rule`, for ``arch``."""
    from mnb.megatron.hf import gpt2, llama, mixtral

    if arch == "GPT2LMHeadModel":
        return gpt2.tensors(cfg)
    if arch == "MixtralForCausalLM":
        return mixtral.tensors(cfg)
    return llama.tensors(cfg)


def expected_tensors(rules: dict[str, Rule]) -> dict[str, tuple[int, ...]]:
    return {name: shape for rule in rules.values() for name, shape in zip(rule.hf, rule.shapes)}


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def canonical_names(chunk) -> dict[str, str]:
    """This chunk's parameter names -> names with global layer and expert numbers (the rules' keys)."""
    from megatron.core import parallel_state as ps

    layers = list(chunk.decoder.layers) if hasattr(chunk, "decoder") else []
    out = {}
    for name, _ in chunk.named_parameters():
        canon = name
        match = _LAYER.match(name)
        if match:
            layer = layers[int(match.group(1))].layer_number - 1
            canon = f"decoder.layers.{layer}." + name[match.end():]
            expert = _EXPERT.search(canon)
            if expert:
                local = int(expert.group(1))
                mlp = layers[int(match.group(1))].mlp
                per_rank = mlp.num_local_experts
                glob = ps.get_expert_model_parallel_rank() * per_rank + local
                canon = canon[:expert.start()] + f".local_experts.{glob}." + canon[expert.end():]
        out[name] = canon
    return out


def tp_coords(rule: Rule) -> tuple[int, int]:
    """(size, rank) of the tensor-parallel group ``rule``'s parameter is split over."""
    from megatron.core import parallel_state as ps

    if rule.expert:
        return ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def heads_of(cfg) -> Heads:
    return Heads(cfg.num_attention_heads, cfg.query_groups, cfg.head_dim)


def _interrupted_save(path: Path) -> Path:
    """``path``, or when ``mnb.save_hf`` stopped between the two renames of its swap, the complete copy it
    left beside it (:func:`mnb.writes.find`; reads only: the next ``save_hf`` to ``path`` renames it)."""
    if path.suffix == ".json" or writes.HF_CHECKPOINT.complete(path):
        return path
    found = writes.find(path.absolute(), writes.HF_CHECKPOINT)  # beside it, or inside a mount point
    if found is None:
        return path
    logger.warning("%s was being replaced when mnb.save_hf stopped; reading %s", path, found)
    return found


def from_hf(path: str | Path, *, fusions: bool | str = "auto", **overrides: Any):
    """This rank's part of the Hugging Face checkpoint in folder ``path``, for the current layout.

    ``overrides`` use :func:`mnb.gpt`'s names (``num_layers=4`` for a shallower copy,
    ``seq_length``, ``sequence_parallel``, TransformerConfig fields).  Architectures:
    :data:`mnb.hf_config.ARCHITECTURES`.  Returns a :class:`~mnb.megatron.model.MegatronModel`
    whose ``tokenizer`` is the checkpoint's (``tokenizer.json``) and whose ``hf`` remembers the
    source for :func:`mnb.save_hf`.  ValueError, the same on every rank and naming the file or
    setting, for a folder without weights, an unknown architecture, tensors that disagree with
    ``config.json``, a missing shard, or a layout that does not divide the model.
    """
    from mnb.megatron import layout as _layout
    from mnb.megatron.model import build_model

    parallel = _layout.require_layout()
    if "sequence_parallel" in overrides:
        parallel = dataclasses.replace(parallel, sequence_parallel=bool(overrides.pop("sequence_parallel")))
    folder = config_path(_interrupted_save(Path(path).expanduser())).parent
    source = read_config(folder)
    arch = architecture(source, str(folder / "config.json"))
    cfg = hf_config(folder, **overrides)
    try:
        cfg.check_parallel(parallel)
    except ValueError as exc:
        raise ValueError(f"{folder.name} ({arch}) under {parallel.describe()}: {exc}") from None
    checkpoint = Checkpoint(folder)
    if (cfg.share_embeddings_and_output_weights and "lm_head.weight" in checkpoint.tensors
            and "share_embeddings_and_output_weights" not in overrides):
        # transformers 5 reads such a folder untied (and warns): the logits come from the file's lm_head
        logger.warning("%s: config.json ties the output layer to the embedding (tie_word_embeddings), but the "
                       "weights hold their own lm_head.weight; reading it untied, as transformers does (pass "
                       "share_embeddings_and_output_weights=True to tie it and ignore lm_head.weight)", folder)
        cfg = cfg.with_overrides(share_embeddings_and_output_weights=False)
    rules = family_tensors(arch, cfg)
    checkpoint.check(expected_tensors(rules), str(folder / "config.json"))
    tokenizer = load_hf_tokenizer(folder)  # None without tokenizer.json; bad files refused before building

    t0 = time.perf_counter()
    model = build_model(cfg, parallel, init="none", fusions=fusions)
    built_s = time.perf_counter() - t0
    log = _fill(model, rules, checkpoint, cfg)
    model.tokenizer = tokenizer
    model.hf = Source(folder=str(folder), config=source, dtype=checkpoint.dtype(), read=log)
    logger.info("from_hf %s: built in %.2f s, read %.2f GB in %.2f s (%.1f GB/s), %d MB staged at most",
                folder, built_s, log.bytes_read / 1e9, log.seconds, log.bytes_read / 1e9 / max(log.seconds, 1e-9),
                log.staged_peak_bytes // 10**6)
    return model


class _Planner:
    """The reader :func:`read_local` sees first: records each slice it asks for, answers with meta tensors."""

    device = torch.device("meta")

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.index: dict[tuple, int] = {}
        self.spans: list = []
        self.dtypes: list = []
        self.shapes: list = []
        self.asked: list[int] = []

    def slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        ident = (key, dim, start, stop)
        if ident not in self.index:
            span, shape = self.checkpoint.span(key, dim, start, stop)
            self.index[ident] = len(self.spans)
            self.spans.append(span)
            self.shapes.append(shape)
            self.dtypes.append(DTYPES[self.checkpoint.tensors[key].dtype])
        i = self.index[ident]
        self.asked.append(i)
        return torch.empty(self.shapes[i], dtype=self.dtypes[i], device="meta")


class _Staged:
    """The reader :func:`read_local` sees second: the slices staged on the rank's device."""

    def __init__(self, planner: _Planner, staged: dict[int, torch.Tensor], device: torch.device) -> None:
        self.planner, self.staged, self.device = planner, staged, device

    def slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        i = self.planner.index[(key, dim, start, stop)]
        return self.staged[i].view(self.planner.dtypes[i]).view(self.planner.shapes[i])


@dataclass(frozen=True)
class Target:
    """One parameter to fill: this rank's part of ``rule``, tp-sliced as (``tp``, ``r``)."""

    param: torch.Tensor
    name: str
    rule: Rule
    tp: int = 1
    r: int = 0


@torch.no_grad()
def fill(targets: list[Target], checkpoint: Checkpoint, vocab_size: int, heads: Heads | None = None,
         progress=None, **one_pass: Any) -> ReadLog:
    """Copy every target's slice from ``checkpoint`` in one pass over its shards (:class:`~.stream.OnePass`).

    ``progress(done, total, log)`` is called after each staged slice.  No collective, no layout:
    the caller says which tp slice each parameter is.  ``one_pass``: :class:`~.stream.OnePass`'s
    ``buffer_bytes``, ``buffers``, ``threads``."""
    # 1. which slices each parameter needs, from meta tensors: shapes checked before a byte is read
    planner = _Planner(checkpoint)
    needs: list[set[int]] = []
    for t in targets:
        planner.asked = []
        local = read_local(t.rule, planner, tuple(t.param.shape), t.tp, t.r, vocab_size, heads)
        if tuple(local.shape) != tuple(t.param.shape):
            raise ValueError(f"{t.name}: the checkpoint gives this rank {list(local.shape)}, the model holds "
                             f"{list(t.param.shape)}; the layout and {checkpoint.folder}/config.json disagree")
        needs.append(set(planner.asked))
    # 2. one pass over the shards; each parameter built on its device as soon as its slices are there
    device = targets[0].param.device if targets else torch.device("cpu")
    one_pass = OnePass(checkpoint.folder, planner.spans, device, **one_pass)
    staged: dict[int, torch.Tensor] = {}
    users: dict[int, list[int]] = {}
    for j, need in enumerate(needs):
        for i in need:
            users.setdefault(i, []).append(j)
    waiting = [len(need) for need in needs]
    reader = _Staged(planner, staged, device)
    done = 0

    def build(j: int) -> None:
        t = targets[j]
        t.param.copy_(read_local(t.rule, reader, tuple(t.param.shape), t.tp, t.r, vocab_size, heads))

    with one_pass.compute():
        for j in (j for j, n in enumerate(waiting) if n == 0):  # only padding rows here
            build(j)
            done += 1
    for i, tensor in one_pass.staged():
        staged[i] = tensor
        with one_pass.compute():
            for j in list(users[i]):
                waiting[j] -= 1
                if waiting[j] == 0:
                    build(j)
                    done += 1
                    for k in needs[j]:
                        users[k].remove(j)
                        if not users[k]:
                            del staged[k]
                            one_pass.release(k)
        if progress is not None:
            progress(done, len(targets), one_pass.log)
    return one_pass.log


def _fill(model, rules: dict[str, Rule], checkpoint: Checkpoint, cfg) -> ReadLog:
    """This rank's slice of every parameter of ``model``, with a progress line on long loads."""
    import torch.distributed as dist

    targets = []
    for chunk in model.chunks:
        for (_, param), canon in zip(chunk.named_parameters(), canonical_names(chunk).values()):
            rule = rules.get(canon)
            if rule is None:
                raise ValueError(f"mnb.from_hf has no Hugging Face name for the Megatron parameter {canon} "
                                 "(a spec mnb's mapping does not cover, e.g. Transformer Engine's fused norms)")
            targets.append(Target(param, canon, rule, *tp_coords(rule)))
    talk = dist.get_rank() == 0
    start = time.perf_counter()
    last = [start]

    def progress(done: int, total: int, log: ReadLog) -> None:
        now = time.perf_counter()
        if talk and now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            print(f"from_hf: {done}/{total} tensors, {log.bytes_read / 2**30:.2f} GiB read on rank 0, "
                  f"{now - start:.0f} s", flush=True)

    return fill(targets, checkpoint, cfg.vocab_size, heads_of(cfg), progress)
