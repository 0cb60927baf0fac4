"""The optimizer state of a Megatron-FSDP model in mnb's layout-free checkpoint format.

Under Megatron-FSDP, Megatron's ``DistributedOptimizer.sharded_state_dict`` offers only
``fsdp_dtensor`` (torch DCP, loadable only by another FSDP model).  mnb's checkpoints store
the distributed optimizer in Megatron's ``fully_reshardable`` format instead: beside Megatron's
common state (``optimizer.param_groups`` with Adam's ``step``), one whole (tp-local) tensor per
parameter and state, keyed ``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``, with the
model tensor's own sharding metadata, so Megatron reshards it into any tp/pp/dp layout.

:func:`sharded_state_dict` builds that form from FSDP's state: each parameter's fp32 main
weight and Adam moments are DTensors cut by dp rows (``optimizer.param_groups`` hold the same
DTensors ``ParamAndGradBuffer.optimizer_named_parameters`` names); they are gathered over dp
(:func:`mnb.megatron.fsdp._gather_rows`, padded for gloo) and given the key and metadata of the
model tensor the raw parameter is.  A DDP model loads it with Megatron's own
``load_parameter_state_from_fully_reshardable``.  :func:`load` is the reverse for a Megatron-FSDP
model: every rank reads the whole tensors (the same request Megatron makes for a DDP model)
and keeps its own rows of each.

A MoE model's state is laid out as Megatron DDP's ``ChainedOptimizer`` lays it (``{0: dense,
1: expert}``, each with its own param groups and ``param_state`` numbering): Megatron-FSDP builds
*one* optimizer over both kinds (``get_megatron_optimizer`` under ``use_megatron_fsdp``: one
optimizer per chunk, ``filter_fn=lambda g: True``), DDP two (dense, then expert), so
:func:`_parts` splits the FSDP optimizer's parameters as DDP does (``allreduce`` False: an
expert under ep > 1), saving and loading.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mnb.megatron import fsdp

PREFIX = "optimizer.state"
STATES = ("param", "exp_avg", "exp_avg_sq")
SHARDING_TYPE = "fully_reshardable"


def _subs(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _parts(optimizer, raw_of: dict) -> list[tuple[torch.optim.Optimizer, list[dict]]]:
    """(torch optimizer, its groups as Megatron DDP would hold them) per optimizer DDP would chain.

    Megatron-FSDP's optimizer takes the FSDP DTensors, which lack the raw parameters' ``allreduce``
    attribute, so its param groups all say ``is_expert_parallel=False``; DDP's
    ``get_megatron_optimizer`` puts a parameter whose ``allreduce`` is False (an expert under
    ep > 1) into a second, expert optimizer.  Each group here is ``{"group": the FSDP param group,
    "params": its DTensors of one kind, "is_expert_parallel": that kind}``: the dense ones, then
    the expert ones; a kind with no parameters is left out (one part for a dense model or ep1).
    """
    out = []
    for sub in _subs(optimizer):
        inner = sub.optimizer
        for expert in (False, True):
            views = []
            for group in inner.param_groups:
                params = [p for p in group["params"] if (not getattr(raw_of[id(p)][1], "allreduce", True)) is expert]
                if params:
                    views.append({"group": group, "params": params, "is_expert_parallel": expert})
            if views:
                out.append((inner, views))
    return out


def _meta(view: dict) -> dict:
    """A view's param group as DDP's optimizer holds it: FSDP's, without params, with DDP's expert flag."""
    return {**{k: v for k, v in view["group"].items() if k != "params"}, "is_expert_parallel": view["is_expert_parallel"]}


def _raw_of(wrapped_chunks: list) -> dict[int, tuple[str, torch.nn.Parameter]]:
    """id(optimizer DTensor) -> (name, the module's raw parameter) for every FSDP chunk."""
    out = {}
    for wrapped in wrapped_chunks:
        inner = wrapped.module  # MegatronFSDP
        for name, dtensor in inner.param_and_grad_buffer.optimizer_named_parameters:
            out[id(dtensor)] = (name, inner.raw_param[name])
    return out


def _model_metadata(model_state: dict) -> dict[int, Any]:
    """id(parameter) -> its ShardedTensor (or factory) in the model's sharded state dict.

    As Megatron's ``sharded_param_state_fully_reshardable`` builds it (last one wins for a
    parameter two keys share).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    tensors, _ = extract_sharded_tensors_and_factories(model_state)
    return {id(sh.data): sh for sh in nested_values(tensors)}


def _as_model_tensor(meta: Any, key: str, data: torch.Tensor) -> Any:
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    kwargs = dict(key=f"{PREFIX}.{key}.{meta.key}", data=data, replica_id=meta.replica_id)
    if not isinstance(meta, ShardedTensorFactory):
        kwargs["dtype"] = data.dtype
    out = dataclasses.replace(meta, **kwargs)
    out.validate_metadata_integrity()
    return out


def _step(inner: torch.optim.Optimizer) -> float:
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    if len(steps) > 1:
        raise RuntimeError(f"Megatron-FSDP's Adam holds different steps {sorted(steps)}: cannot save one")
    return steps.pop() if steps else 0.0


def _param_groups(inner: torch.optim.Optimizer, views: list[dict]) -> list[dict]:
    """Megatron's common optimizer state: the param groups without params, Adam's step in each."""
    step = _step(inner)
    return [{**_meta(v), "step": step} for v in views]


def sharded_state_dict(optimizer, model_state: dict, wrapped_chunks: list, *, is_loading: bool) -> dict:
    """The optimizer part of an mnb checkpoint for a Megatron-FSDP model (a collective on save).

    ``model_state``: the chunks' sharded state dict, built inside
    :func:`mnb.megatron.fsdp.whole_parameters` (its tensors are the raw parameters).  Saving,
    the tensors hold the gathered state; loading, empty whole tensors to read into.
    """
    raw_of, metadata = _raw_of(wrapped_chunks), _model_metadata(model_state)
    out = {}
    for i, (inner, views) in enumerate(_parts(optimizer, raw_of)):
        param_state = {}
        index = 0
        for view in views:
            for dtensor in view["params"]:
                name, raw = raw_of[id(dtensor)]
                meta = metadata.get(id(raw))
                if meta is None:
                    raise RuntimeError(f"Megatron-FSDP parameter {name} is not in the model's sharded state dict")
                state = inner.state.get(dtensor, {})
                tensors = {}
                for key in STATES:
                    if is_loading:
                        whole = torch.empty(raw.shape, dtype=torch.float32, device=raw.device)
                    else:
                        whole = fsdp._gather_rows(dtensor, _local_state(dtensor, state, key, name))
                        whole = whole.float().reshape(raw.shape)
                    tensors[key] = _as_model_tensor(meta, key, whole)
                param_state[index] = tensors
                index += 1
        out[i] = {"optimizer": {"param_groups": _param_groups(inner, views)}, "param_state": param_state,
                  "param_state_sharding_type": SHARDING_TYPE}
    return out[0] if len(out) == 1 else out


def _local_state(dtensor: Any, state: dict, key: str, name: str) -> torch.Tensor:
    """This rank's shard of ``key`` (the main weight or an Adam moment) of one FSDP parameter.

    Adam keeps no state for a parameter whose shard here is empty (zero rows): zero rows then.
    """
    local = dtensor.to_local()
    if key == "param":
        return local
    value = state.get(key)
    if value is None:
        if local.numel():
            raise RuntimeError(f"Megatron-FSDP's Adam has no {key} for {name}: train a step before saving")
        return local.new_zeros(local.shape, dtype=torch.float32)
    return value.to_local() if hasattr(value, "to_local") else value


def _local_rows(whole: torch.Tensor, local: torch.Tensor, start: int) -> torch.Tensor:
    """This dp rank's rows of ``whole``: the ``local`` shard's, from row ``start``."""
    return whole.reshape(-1, *local.shape[1:])[start: start + local.shape[0]] if local.dim() else whole


def load(optimizer, loaded: Any, wrapped_chunks: list) -> None:
    """Put what :func:`sharded_state_dict` (``is_loading=True``) read into Megatron-FSDP's Adam."""
    parts = _parts(optimizer, _raw_of(wrapped_chunks))
    saved = [loaded] if len(parts) == 1 else [loaded[i] for i in range(len(parts))]
    for (inner, views), part in zip(parts, saved):
        if part.get("param_state_sharding_type") != SHARDING_TYPE:
            raise ValueError(f"the checkpoint's optimizer state is {part.get('param_state_sharding_type')!r}, "
                             f"mnb reads {SHARDING_TYPE!r} into Megatron-FSDP")
        steps = {float(g["step"]) for g in part["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            raise ValueError(f"the checkpoint's optimizer param groups hold steps {sorted(steps)}, not one")
        step = steps.pop()
        _check_groups(part["optimizer"]["param_groups"], views)
        index = 0
        with torch.no_grad():
            for view in views:
                for dtensor in view["params"]:
                    tensors = part["param_state"][index]
                    index += 1
                    local = dtensor.to_local()
                    start = fsdp.row_offset(dtensor)  # a collective over dp: before any rank skips
                    rows = {key: _local_rows(tensors[key], local, start) for key in STATES}
                    if not local.numel():
                        continue  # no rows here (and no Adam state)
                    state = inner.state[dtensor]
                    local.copy_(rows["param"].to(local.dtype))
                    for key in ("exp_avg", "exp_avg_sq"):
                        target = state[key]
                        target_local = target.to_local() if hasattr(target, "to_local") else target
                        target_local.copy_(rows[key].to(target_local.dtype))
                    if isinstance(state.get("step"), torch.Tensor):
                        state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)
                    else:
                        state["step"] = step
    for wrapped in wrapped_chunks:  # the compute weights follow the loaded main weights
        wrapped.module.param_and_grad_buffer.copy_main_weights_to_model_weights()


def _check_groups(saved: list[dict], views: list[dict]) -> None:
    """The checkpoint's param groups must be this optimizer's (same lr/wd multipliers), in any order."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys as keys

    ident = lambda g: tuple(g.get(k, g.get(f"pre_{k}")) for k in keys)  # noqa: E731
    missing = {ident(_meta(v)) for v in views} - {ident(g) for g in saved}
    if missing:
        raise ValueError(f"the checkpoint's optimizer has no param group {sorted(missing)} {keys}: it was "
                         "trained with other settings; load with load_optimizer=False")
    by_ident = {ident(g): g for g in saved}
    for view in views:  # FSDP's own expert flag stays (its groups hold both kinds)
        view["group"].update({k: v for k, v in by_ident[ident(_meta(view))].items()
                              if k not in ("params", "step", "is_expert_parallel")})
