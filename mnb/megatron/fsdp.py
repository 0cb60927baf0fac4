"""Megatron-FSDP: ZeRO-1/2/3 as a way of wrapping the model (``%%megatron --fsdp``).

Inside a cell::

    %%megatron --fsdp                     # optim_grads_params (ZeRO-3); or --fsdp optim / optim_grads
    model = mnb.gpt("tiny")
    mnb.train(model, steps=10)            # Megatron-FSDP + Megatron's distributed optimizer

``mnb.train`` wraps the chunks with Megatron-Core's own ``FullyShardedDataParallel``
(``megatron.core.distributed.fsdp.mcore_fsdp_adapter``, the wrapper behind Megatron-LM's
``--use-megatron-fsdp``) instead of its ``DistributedDataParallel``, with
``data_parallel_sharding_strategy`` = the layout's ``fsdp``; the optimizer is Megatron's
distributed optimizer over FSDP's sharded buffers (``get_megatron_optimizer`` sees
``ddp_config.use_megatron_fsdp``), as Megatron-LM forces it.  The process groups are the
same as without FSDP: the strategy shards over the dp x cp group.

What is needed around Megatron (megatron-core 0.16.1 and 0.19.2 both ship it):

- the adapter builds its device mesh with ``einops.rearrange`` (``_get_dp_tp_mesh``), a
  package megatron-core does not depend on: where einops is missing, :func:`_dp_tp_mesh`
  (the same arrangement, ranks ordered dp*cp x ep x tp, with the same consistency checks)
  takes its place;
- on CPU ranks, :mod:`mnb.megatron.cpu` makes Megatron's ``torch.device("cuda:...")`` and
  ``DeviceMesh(... "cuda")`` the CPU's, so the DTensor shards stay on the CPU.

pp > 1 is refused in :class:`mnb.config.ParallelConfig` (the adapter's mesh has no pipeline
dimension).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def _adapter():
    try:
        from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    except ImportError as exc:  # pragma: no cover - both supported versions ship it
        raise RuntimeError(
            f"this megatron-core has no Megatron-FSDP (megatron.core.distributed.fsdp: {exc}); "
            "use megatron-core 0.16 or newer, or drop --fsdp"
        ) from exc
    if not getattr(mcore_fsdp_adapter, "HAVE_MEGATRON_FSDP", True):
        raise RuntimeError(
            "Megatron-FSDP did not import in this megatron-core "
            f"({getattr(mcore_fsdp_adapter, 'IMPORT_MEGATRON_FSDP_ERROR', '?')}); drop --fsdp"
        )
    if not getattr(mcore_fsdp_adapter, "HAVE_EINOPS", False):
        mcore_fsdp_adapter._get_dp_tp_mesh = _dp_tp_mesh
    return mcore_fsdp_adapter


def _dp_tp_mesh(dp_cp_group, tp_group, ep_size: int = 1) -> torch.Tensor:
    """The (dp*cp, tp) block of ranks this rank belongs to, as Megatron-FSDP's adapter arranges them.

    World ranks in Megatron's order (tp fastest, then ep, then dp*cp; no pp) as an
    ``[ep, dp_cp, tp]`` grid; this rank's ``[dp_cp, tp]`` slice.  The rows and columns must
    be exactly the ranks of ``dp_cp_group`` and ``tp_group``: anything else would shard
    over the wrong ranks, so it raises.
    """
    dist = torch.distributed
    world = dist.get_world_size()
    tp = tp_group.size() if tp_group is not None else 1
    dp_cp = dp_cp_group.size()
    if dp_cp * ep_size * tp != world:
        raise ValueError(
            f"Megatron-FSDP's mesh needs dp*cp({dp_cp}) * ep({ep_size}) * tp({tp}) = world size({world}); "
            "pipeline parallelism does not combine with --fsdp"
        )
    grid = torch.arange(world).reshape(dp_cp, ep_size, tp).permute(1, 0, 2)
    rank = dist.get_rank()
    mine = [block for block in grid if rank in block.reshape(-1).tolist()]
    block = mine[0]
    column = next(col for col in block.t().tolist() if rank in col)
    row = next(r for r in block.tolist() if rank in r)
    if sorted(column) != sorted(dist.get_process_group_ranks(dp_cp_group)) or (
            tp_group is not None and sorted(row) != sorted(dist.get_process_group_ranks(tp_group))):
        raise ValueError(
            f"rank {rank}: Megatron-FSDP's mesh {block.tolist()} does not match the dp*cp group "
            f"{dist.get_process_group_ranks(dp_cp_group)} and the tp group; the layout's rank order "
            "is not Megatron's default tp-cp-ep-dp"
        )
    return block


def ddp_config(strategy: str, *, grad_reduce_in_fp32: bool = True) -> Any:
    """Megatron's ``DistributedDataParallelConfig`` for Megatron-FSDP with ``strategy``."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=True,  # Megatron-FSDP's optimizer is the distributed one
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
    )


def wrap(config: Any, module: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    """``module`` wrapped with Megatron-Core's ``FullyShardedDataParallel`` (one chunk: pp is 1)."""
    adapter = _adapter()
    return adapter.FullyShardedDataParallel(config, ddp_config(strategy), module, device=device)


def is_fsdp(wrapped: Any) -> bool:
    """True for a chunk wrapped by :func:`wrap`."""
    return bool(getattr(getattr(wrapped, "ddp_config", None), "use_megatron_fsdp", False))


def buffer_tensors(wrapped: Any) -> dict[str, list[torch.Tensor]]:
    """This rank's storages of an FSDP chunk, by what they hold: ``weights`` (the model's
    compute weights and fp32 main weights, sharded unless ``optim``/``optim_grads`` keep
    the compute copy whole) and ``gradients`` (the main-gradient buffer, sharded from
    ``optim_grads`` on).  Read from Megatron-FSDP's ``ParamAndGradBuffer`` groups."""
    out: dict[str, list[torch.Tensor]] = {"weights": [], "gradients": []}
    buffer = getattr(wrapped, "param_and_grad_buffer", None)
    for group in getattr(buffer, "parameter_groups", None) or []:
        for name, kind in (("model_weight_buffer", "weights"), ("main_weight_buffer", "weights"),
                           ("main_grad_buffer", "gradients")):
            data = getattr(getattr(group, name, None), "data", None)
            if isinstance(data, torch.Tensor):
                out[kind].append(data)
    return out
