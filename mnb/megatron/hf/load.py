"""``mnb.from_hf(path, **overrides)``: this rank's part of a Hugging Face checkpoint, for the current layout.

Inside a ``%%megatron --tp 2 --pp 2`` cell::

    model = mnb.from_hf("/models/Llama-3.2-1B")                     # every layout mnb.gpt takes
    model = mnb.from_hf("/models/Llama-3.2-1B", num_layers=4, seq_length=512)
    mnb.train(model, steps=3, data="notes/")                        # its own tokenizer (model.tokenizer)

Steps, the same on every rank: ``config.json`` -> :class:`ModelConfig` (:func:`mnb.hf_config`),
the layout checked against it, the safetensors headers checked against the config (every
tensor there, every shape right, every shard of the index present), the chunks built without
initialising their weights, then each parameter filled from only the rows or columns this rank
holds (``safe_open(...).get_slice``).  Nothing reads the whole model on one rank.
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
from mnb.megatron.hf.reader import Checkpoint
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
    if path.exists() or path.suffix == ".json":
        return path
    found = writes.find(path.absolute(), writes.HF_CHECKPOINT)
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
    rules = family_tensors(arch, cfg)
    checkpoint = Checkpoint(folder)
    checkpoint.check(expected_tensors(rules), str(folder / "config.json"))
    tokenizer = load_hf_tokenizer(folder)  # None without tokenizer.json; bad files refused before building

    t0 = time.perf_counter()
    model = build_model(cfg, parallel, init="none", fusions=fusions)
    built_s = time.perf_counter() - t0
    _fill(model, rules, checkpoint, cfg)
    model.tokenizer = tokenizer
    model.hf = Source(folder=str(folder), config=source, dtype=checkpoint.dtype())
    logger.info("from_hf %s: built in %.2f s, loaded in %.2f s", folder, built_s, time.perf_counter() - t0 - built_s)
    return model


@torch.no_grad()
def _fill(model, rules: dict[str, Rule], checkpoint: Checkpoint, cfg) -> None:
    """Copy this rank's slice of every parameter from the checkpoint, with a progress line on long loads."""
    import torch.distributed as dist

    heads = heads_of(cfg)
    params = [(p, canon) for chunk in model.chunks
              for (name, p), canon in zip(chunk.named_parameters(), canonical_names(chunk).values())]
    talk = dist.get_rank() == 0
    start = last = time.perf_counter()
    done_bytes = 0
    for i, (param, canon) in enumerate(params):
        rule = rules.get(canon)
        if rule is None:
            raise ValueError(f"mnb.from_hf has no Hugging Face name for the Megatron parameter {canon} "
                             "(a spec mnb's mapping does not cover, e.g. Transformer Engine's fused norms)")
        tp, r = tp_coords(rule)
        local = read_local(rule, checkpoint, tuple(param.shape), tp, r, cfg.vocab_size, heads)
        if tuple(local.shape) != tuple(param.shape):
            raise ValueError(f"{canon}: the checkpoint gives this rank {list(local.shape)}, the model holds "
                             f"{list(param.shape)}; the layout and {checkpoint.folder}/config.json disagree")
        param.copy_(local)
        done_bytes += local.numel() * local.element_size()
        now = time.perf_counter()
        if talk and now - last >= PROGRESS_EVERY_S:
            last = now
            print(f"from_hf: {i + 1}/{len(params)} tensors, {done_bytes / 2**30:.2f} GiB on rank 0, "
                  f"{now - start:.0f} s", flush=True)
