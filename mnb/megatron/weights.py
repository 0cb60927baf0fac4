"""Layout-invariant weight initialisation.

Megatron initialises each rank's shard from an RNG stream whose position
depends on the layout.  ``use_cpu_initialization=True`` builds the full master
weight on every rank and keeps this rank's slice, so tp shards agree with a
single rank, but the CPU generator is consumed in construction order, so
pipeline stage 1 draws different numbers for layer 3 than a single rank does.
Checked on 0.16.1, tiny preset, ``init="megatron"``: step-0 loss 6.252837 at
tp=1 and tp=2, 6.252370 at pp=2.

:func:`init_layout_invariant` instead fills every randomly initialised
weight from a generator seeded by (seed, checkpoint key, layer/expert index),
and copies this rank's slice of that full tensor.  The global shape and this
rank's offsets come from Megatron's own ``sharded_state_dict()`` (the same
metadata dist_checkpointing uses), so any tp/pp/vpp/ep layout starts from the
same model.  Distributions match Megatron's: ``N(0, init_method_std)``;
``linear_proj`` and ``linear_fc2`` (attention and MLP output layers)
``N(0, init_method_std / sqrt(2 * num_layers))``; norms and biases keep
Megatron's constant init.

Cost: each rank generates the full (unsharded) tensor of every weight it holds
a slice of, one tensor at a time, on the weight's device (for a 128k x 8k
embedding, a 4 GiB fp32 temporary).  ``mnb.gpt(..., init="megatron")`` keeps
Megatron's own initialisation instead.
"""

from __future__ import annotations

import math
import zlib

import torch


def _leaves(obj):
    """Sharded tensors of a (nested) sharded state dict, expanding factories."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(obj, dict):
        for value in obj.values():
            yield from _leaves(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _leaves(value)
    elif isinstance(obj, ShardedTensorFactory):
        yield from _leaves(obj.build())
    elif isinstance(obj, ShardedTensor):
        yield obj


def _std(key: str, transformer_config) -> float | None:
    """Megatron's init std for a weight key, or None for constant-initialised tensors."""
    name = key.rsplit(".", 1)[-1]
    if name != "weight" or "norm" in key.rsplit(".", 2)[-2]:
        return None
    std = transformer_config.init_method_std
    if "linear_proj." in key or "linear_fc2." in key:
        return std / math.sqrt(2.0 * transformer_config.num_layers)
    if "embedding" in key:
        return getattr(transformer_config, "embedding_init_method_std", None) or std
    return std


@torch.no_grad()
def init_layout_invariant(chunks, transformer_config, seed: int) -> int:
    """Re-initialise the random weights of ``chunks`` layout-invariantly; returns tensors touched."""
    touched = 0
    seen: set[int] = set()
    for chunk in chunks:
        for sh in _leaves(chunk.sharded_state_dict()):
            if sh.flattened_range is not None or sh.data is None:
                continue
            std = _std(sh.key, transformer_config)
            if std is None or sh.data.dim() < 1:
                continue
            p = sh.prepend_axis_num
            full_shape = tuple(sh.global_shape[p:])
            if len(full_shape) < 2:
                continue
            # Tied output layer or the two halves of a gated fc1: each view once.
            ident = (sh.data.data_ptr(), tuple(sh.global_offset))
            if ident in seen:
                continue
            seen.add(ident)
            prefix = tuple(sh.global_offset[:p])
            name = f"{seed}|{sh.key}|{prefix}"
            gen = torch.Generator(device=sh.data.device)
            gen.manual_seed(zlib.crc32(name.encode()) + (seed << 32))
            full = torch.empty(full_shape, dtype=torch.float32, device=sh.data.device)
            full.normal_(0.0, std, generator=gen)
            index = tuple(
                slice(off, off + size) for off, size in zip(sh.global_offset[p:], sh.data.shape)
            )
            sh.data.copy_(full[index].to(sh.data.dtype))
            touched += 1
    return touched
