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
- megatron-core 0.16.1's adapter tests ``isinstance(module, (TELinear,))`` with tp > 1, and
  ``TELinear`` is a ``MagicMock`` without Transformer Engine: :class:`_NoTELinear` stands in;
- on CPU ranks, :mod:`mnb.megatron.cpu` makes Megatron's ``torch.device("cuda:...")`` and
  ``DeviceMesh(... "cuda")`` the CPU's, so the DTensor shards stay on the CPU;
- on CPU ranks (gloo) every collective of the FSDP buffers' groups finishes before it returns and
  none is coalesced (:func:`_one_by_one`): gloo's asynchronous and coalesced collectives, kept in
  flight by Megatron-FSDP around storages it resizes, crashed a rank every few hundred ZeRO-3 steps;
- megatron-core 0.16's Megatron-FSDP gives a gradient buffer whose dp group is one rank (the
  experts' when ep = dp*cp, e.g. ``--ep 2`` on 2 ranks or ``--ep 4`` on 4; every buffer when
  dp*cp = 1) twice its gradient: :func:`_halve_before_single_rank_reduce` (0.19.2 is right).

pp > 1 is refused in :class:`mnb.config.ParallelConfig` (the adapter's mesh has no pipeline
dimension).
"""

from __future__ import annotations

import contextlib
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
    if "TELinear" in vars(mcore_fsdp_adapter) and not isinstance(mcore_fsdp_adapter.TELinear, type):
        mcore_fsdp_adapter.TELinear = _NoTELinear
    return mcore_fsdp_adapter


class _NoTELinear:
    """Stands for Transformer Engine's ``TELinear`` where TE is absent: no module is one.

    megatron-core 0.16.1's adapter asks ``isinstance(module, (TELinear,))`` for every
    parameter when tp > 1, and without TE ``megatron.core.extensions.transformer_engine``
    leaves ``TELinear`` a ``MagicMock`` (a TypeError: not a type).
    """


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
        gradient_reduce_div_fusion=False,  # scale in place (_halve_before_single_rank_reduce relies on it)
    )


def wrap(config: Any, module: torch.nn.Module, strategy: str, device: torch.device) -> torch.nn.Module:
    """``module`` wrapped with Megatron-Core's ``FullyShardedDataParallel`` (one chunk: pp is 1)."""
    adapter = _adapter()
    on_gloo = device.type == "cpu"
    if on_gloo:
        _uncoalesced_on_gloo()
    wrapped = adapter.FullyShardedDataParallel(config, ddp_config(strategy), module, device=device)
    if on_gloo:
        from mnb.megatron import collectives

        for group in _buffer_groups(wrapped):
            collectives.complete_before_return(group)
    _halve_before_single_rank_reduce(wrapped)
    return wrapped


def _buffer_groups(wrapped: Any) -> list:
    """The process groups Megatron-FSDP's buffers gather and reduce over (dp*cp; the experts' own for MoE)."""
    found = {}
    buffer = getattr(wrapped.module, "param_and_grad_buffer", None)
    for group in getattr(buffer, "parameter_groups", None) or []:
        for name in ("model_weight_buffer", "main_weight_buffer", "main_grad_buffer", "transpose_weight_buffer",
                     "hsdp_wbuf", "hsdp_gbuf"):
            pg = getattr(getattr(group, name, None), "data_parallel_group", None)
            if pg is not None:
                found[id(pg)] = pg
    return list(found.values())


class _Finished:
    """What :func:`_one_by_one` hands Megatron-FSDP as a coalesced batch's work: its calls already finished."""

    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops: bool = False):
    """torch's ``_coalescing_manager`` as Megatron-FSDP sees it on gloo ranks: no coalescing, each call on
    its own and finished when it returns (``group`` made synchronous: :func:`mnb.megatron.collectives.
    complete_before_return`).  gloo's coalesced all-gather and reduce-scatter never run, and no work is
    left in flight for Megatron to wait on through the batch's handle (:class:`_Finished`)."""
    from mnb.megatron import collectives

    collectives.complete_before_return(group if group is not None else torch.distributed.group.WORLD)
    yield _Finished()


def _uncoalesced_on_gloo() -> None:
    """Point Megatron-FSDP's ``_coalescing_manager`` at :func:`_one_by_one` (CPU ranks only: gloo)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer

    param_and_grad_buffer._coalescing_manager = _one_by_one


def _adds_unsharded_buffer_to_itself() -> bool:
    """Whether this megatron-core's Megatron-FSDP doubles a one-rank dp group's gradients.

    megatron-core 0.16 does (measured on 0.16.1); 0.19 does not (0.19.2's reduce installs the
    result in place); mnb supports no version in between.
    """
    import megatron.core

    major_minor = tuple(int(part) for part in megatron.core.__version__.split(".")[:2])
    return major_minor < (0, 19)


SINGLE_RANK_SCALE = 0.5
"""Megatron-FSDP's scaling of a one-rank dp group's gradients before its reduce (see below)."""


def _halve_before_single_rank_reduce(wrapped: Any) -> list[int]:
    """Make Megatron-FSDP's gradient reduce right for a buffer whose dp group is one rank.

    Megatron-FSDP (``optim_grads``/``optim_grads_params``) leaves a gradient buffer unsharded when its dp group has one rank
    (``is_data_distributed=... and main_buf_dp_group.size() > 1``); its reduce then takes the
    bucket as a view of the buffer itself, reduce-scatters it over the one rank into a new
    tensor (a copy) and *adds* that copy to the buffer's shard (``local_grad += reduced_grad``,
    meant for a sharded buffer and a separate bucket): the buffer holds 2x its gradient after
    one microbatch, 2*(2*g1 + g2) after two.  Under expert parallelism that is the experts'
    buffer whenever ep = dp*cp (expert dp group of one): measured on CPU ranks with moe-tiny,
    ``--ep 4`` on 4 ranks gives a grad norm of 0.8987 against DDP's 0.8760 at step 1 and, with
    two microbatches per rank, losses 2.7e-4 (relative) off DDP's at step 2; ``--ep 2`` on 4 ranks
    (expert dp of two) is DDP's to fp32 rounding.  Adam hides a uniform 2x (the one-microbatch
    run is off by 1e-7), the clipping and the microbatch weighting do not.

    The fix uses Megatron's own scaling hook: with ``gradient_scaling_factor`` 0.5 (and
    ``gradient_reduce_div_fusion`` off, so the scaling is an in-place ``mul_`` of the bucket),
    the buffer holds g/2 and the copy added to it g/2: g, exactly in fp32.  mnb's models use
    Megatron's per-token loss, whose scaling factor is otherwise None (a plain sum), so nothing
    else is scaled.  megatron-core 0.19.2 reduce-scatters such a buffer in place and adds nothing
    (``if gbuf.is_data_distributed or custom_grad_comm_dtype``): there the halving would halve the
    gradient, so it applies only where :func:`_adds_unsharded_buffer_to_itself`.  Returns the
    indices of the parameter groups it scaled (for tests and logs).
    """
    buffer = wrapped.param_and_grad_buffer
    if (buffer.ddp_config.data_parallel_sharding_strategy not in ("optim_grads", "optim_grads_params")
            or not _adds_unsharded_buffer_to_itself()):
        return []
    if buffer.ddp_config.average_in_collective or buffer.ddp_config.gradient_reduce_div_fusion:
        raise RuntimeError("Megatron-FSDP with average_in_collective or gradient_reduce_div_fusion: "
                           "mnb cannot correct a one-rank dp group's gradients there")
    scaled = []
    for index, group in enumerate(buffer.parameter_groups):
        grads = group.main_grad_buffer
        if grads is None or grads.is_data_distributed or grads.data_parallel_group.size() != 1:
            continue
        if grads.gradient_scaling_factor is not None:
            raise RuntimeError(f"Megatron-FSDP scales parameter group {index}'s gradients by "
                               f"{grads.gradient_scaling_factor} (not a per-token loss): mnb cannot "
                               "correct its one-rank dp group's reduce")
        grads.gradient_scaling_factor = SINGLE_RANK_SCALE
        scaled.append(index)
    if scaled:
        logger.info("Megatron-FSDP: %d gradient buffer(s) with a one-rank dp group halved before their "
                    "reduce (it adds a copy of the buffer to itself)", len(scaled))
    return scaled


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


def gathered_storages(wrapped: Any) -> list:
    """The storages of the all-gather buckets an FSDP chunk holds gathered now (ZeRO-3's unsharded
    weights; none below ZeRO-3, where the model weight buffer is whole).

    Megatron-FSDP allocates each bucket from its buffer's ``temporary_bucket_allocator`` and frees it
    by resizing the storage to 0 bytes (``_free_storage``), keeping the ``Bucket``: a freed one has no
    bytes.  A resized storage moves, so these are read anew at each moment asked.
    """
    out = []
    buffer = getattr(wrapped, "param_and_grad_buffer", None)
    for group in getattr(buffer, "parameter_groups", None) or []:
        weights = getattr(group, "model_weight_buffer", None)
        if weights is None or not getattr(weights, "is_data_distributed", False):
            continue
        bucket = getattr(weights.temporary_bucket_allocator, "buckets", {}).get(weights.bucket_index.bucket_id)
        data = getattr(bucket, "data", None)
        if isinstance(data, torch.Tensor) and data.untyped_storage().nbytes():
            out.append(data.untyped_storage())
    return out


@contextlib.contextmanager
def whole_parameters(wrapped_chunks: list):
    """Inside: the chunks' own modules hold whole (this tp rank's) parameters, gathered over dp.

    Megatron-FSDP keeps each parameter as a dp-sharded DTensor (``optimizer_named_parameters``
    of its ``ParamAndGradBuffer``) and swaps them into the module before the optimizer step and
    before any ``state_dict`` (a pre-hook).  A layout-free checkpoint (:mod:`mnb.megatron.checkpoint`)
    needs Megatron's ``sharded_state_dict`` of plain tensors instead: each shard is gathered
    (:func:`_gather_rows`), cast to the module's own dtype, placed in the
    module's raw parameters, and the hook is told the parameters are already in place; on the way
    out the module's parameters are what they were.  A collective: every rank of the pool.
    """
    restore = []
    try:
        for wrapped in wrapped_chunks:
            if not is_fsdp(wrapped):
                continue
            inner = wrapped.module  # MegatronFSDP
            was_distributed = inner.is_param_fsdp_distributed
            kept = {name: raw.data for name, raw in inner.raw_param.items()}
            restore.append((inner, was_distributed, kept))
            sharded = dict(inner.param_and_grad_buffer.optimizer_named_parameters)
            for name, raw in inner.raw_param.items():
                whole = _gather_rows(sharded[name])
                if tuple(whole.shape) != tuple(raw.shape):
                    raise RuntimeError(f"Megatron-FSDP gathered {name} as {tuple(whole.shape)}, the module "
                                       f"holds {tuple(raw.shape)}: this megatron-core's sharding is not dp-only")
                raw.data = whole.to(raw.dtype)
            inner._replace_param_with_raw_if_needed()
            inner.is_param_fsdp_distributed = True  # the state_dict pre-hook leaves the whole ones in place
        yield
    finally:
        for inner, was_distributed, kept in reversed(restore):
            for name, raw in inner.raw_param.items():
                raw.data = kept[name]
            inner.is_param_fsdp_distributed = False  # the truth: the raw parameters are installed
            if was_distributed:
                inner._replace_param_with_distributed_if_needed()


def sharded_chunks(model: Any) -> list:
    """The Megatron-FSDP chunks of an mnb model once trained (else ``[]``)."""
    return [w for w in getattr(model, "wrapped", None) or [] if is_fsdp(w)]


def ready_for_direct_forward(model: Any) -> None:
    """Let code call the model's own chunks (not the wrappers), as ``mnb.generate`` does.

    Megatron-FSDP's wrapper first puts the module's own (raw) parameters back in place of the
    optimizer's DTensor shards, then its per-layer hooks gather them; a call that bypasses the
    wrapper meets the DTensors (megatron-core 0.19.2: ``KeyError`` in ``all_gather_params``).
    This does that first step (``MegatronFSDP._replace_param_with_raw_if_needed``, what its
    ``forward`` runs); the hooks do the rest.
    """
    for wrapped in sharded_chunks(model):
        wrapped.module._replace_param_with_raw_if_needed()


def check_load(model: Any, meta: dict, wants_optimizer: bool) -> None:
    """Refuse, before any collective, what ``mnb.load`` cannot do under Megatron-FSDP.

    A model FSDP already wrapped holds DTensor shards its ``load_state_dict`` cannot fill in
    place; a model about to be wrapped (the cell's ``--fsdp``) trains with Megatron's distributed
    optimizer, so it takes only a distributed optimizer's state (saved under ``--fsdp`` or with
    ``use_distributed_optimizer=True``; :mod:`mnb.megatron.fsdp_optim`).
    """
    from mnb.megatron import layout

    if sharded_chunks(model):
        raise ValueError(
            f"mnb.load into a model Megatron-FSDP already wraps (fsdp={model.parallel.fsdp!r}, trained): "
            "build a new one (mnb.gpt) under --fsdp and load into it before its first mnb.train"
        )
    current = layout.current_layout()
    saved = (meta.get("optimizer_config") or {}).get("use_distributed_optimizer")
    if wants_optimizer and current is not None and current.fsdp is not None and saved is False:
        raise ValueError(
            f"under --fsdp {current.fsdp} the optimizer is Megatron's distributed one, and the checkpoint's "
            "optimizer state was saved with use_distributed_optimizer=False: save it from a model trained with "
            "use_distributed_optimizer=True (or under --fsdp), or mnb.load(path, model, load_optimizer=False) "
            "loads the weights and the progress, and training continues with a fresh optimizer"
        )


DP_DIM = "dp_cp"
"""The mesh dimension Megatron-FSDP's adapter shards over (its tp dimension only describes tp's split)."""


def _row_counts(dtensor: Any) -> tuple[Any, list[int], int] | None:
    """(dp group, rows each dp rank holds, this rank's index) of a Megatron-FSDP DTensor; None if whole.

    Megatron-FSDP cuts each (tp-local) parameter at flat-buffer boundaries, so dp ranks hold
    different numbers of rows (possibly none).  A collective over the dp group.
    """
    from torch.distributed.tensor import Shard

    local = dtensor.to_local()
    names = list(dtensor.device_mesh.mesh_dim_names or ())
    dims = [names.index(DP_DIM)] if DP_DIM in names else \
        [i for i, p in enumerate(dtensor.placements) if isinstance(p, Shard)]
    if not dims or not isinstance(dtensor.placements[dims[0]], Shard):
        return None
    if len(dims) > 1 or dtensor.placements[dims[0]].dim != 0:
        raise RuntimeError(f"Megatron-FSDP parameter sharded as {dtensor.placements}: mnb gathers dim-0 dp shards only")
    group = dtensor.device_mesh.get_group(dims[0])
    dist = torch.distributed
    rows = torch.tensor([local.shape[0] if local.dim() else 0], dtype=torch.long, device=local.device)
    counts = [torch.zeros_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, rows, group=group)
    return group, [int(c) for c in counts], dist.get_rank(group)


def row_offset(dtensor: Any) -> int:
    """The first row of the (tp-local) whole tensor this dp rank's shard of ``dtensor`` holds."""
    found = _row_counts(dtensor)
    return 0 if found is None else sum(found[1][: found[2]])


def _gather_rows(dtensor: Any, local: torch.Tensor | None = None) -> torch.Tensor:
    """This tp rank's whole tensor of a Megatron-FSDP DTensor: its rows gathered over the dp mesh dimension.

    ``local``: another tensor cut as ``dtensor`` is (an Adam moment of it), gathered instead.
    Megatron's own ``gather_uneven_dtensor_to_full_tensor`` all-gathers tensors of different
    sizes, which gloo refuses; here each rank's rows are padded to the largest count,
    all-gathered over that mesh dimension's group, and cut back.
    """
    local = dtensor.to_local() if local is None else local
    found = _row_counts(dtensor)
    if found is None:
        return local
    group, counts, _ = found
    padded = local.new_zeros((max(counts), *local.shape[1:]))
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in counts]
    torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([piece[:n] for piece, n in zip(pieces, counts)])
