"""Save and load models through Megatron-Core's ``dist_checkpointing``.

Inside ``%%megatron`` cells (every rank runs the same line)::

    model = mnb.gpt("tiny"); mnb.train(model, steps=20, data="stdlib")
    mnb.save("ckpt/run1", model)            # weights + optimizer + lr schedule + progress + rng
    ...                                     # later, possibly under another layout:
    model = mnb.gpt("tiny")
    info = mnb.load("ckpt/run1", model)     # {'step': 20, 'optimizer_loaded': True, ...}
    mnb.train(model, steps=20)              # continues: same optimizer state and schedule, next samples

The checkpoint is a Megatron distributed checkpoint (``torch_dist`` format) of
``chunk.sharded_state_dict()`` for every model chunk, plus the Megatron
optimizer's ``sharded_state_dict``, so it loads into any other tp/pp/vpp/dp
layout: Megatron reshards tensors by their global keys (the distributed
optimizer is saved in its ``fully_reshardable`` format). Beside it, ``mnb.json``
(written last) records the model's ``steps_done`` and ``consumed_samples`` (the
data position ``mnb.train`` resumes from), the learning-rate schedule (the settings of the
model's train calls and Megatron's ``opt_param_scheduler`` state, as Megatron-LM saves it),
the layout it was saved under, the
model and optimizer settings and a user ``extra`` dict. Losses continue exactly
across layouts as long as the padded vocabulary is the same (it is a multiple
of 128 * tp; the tiny preset's 512 is the same for tp 1, 2 and 4): padding rows
are real logits.

Atomic: ranks write into ``<path>.tmp-<id>``; after every rank finished (barrier)
rank 0 moves the previous checkpoint aside, renames the new one into place, moves
over what the user kept in the folder, then deletes the old one (:mod:`mnb.writes`,
shared with ``mnb.save_hf``). A folder holding something other than a checkpoint is
refused unless ``overwrite=True``. A save interrupted at any point leaves the last complete
checkpoint loadable (:func:`load` also finds it if the process died between the
two renames; the next save completes that swap and deletes leftovers). The
checkpoint folder must be on storage that every rank sees (one host, or a
shared filesystem). Both functions are collectives: call them on every rank.

Rank 0 decides where and how before any rank writes, and every rank gets the same
plan (:func:`mnb.writes.prepare`): a ``path`` that is a link to a folder is followed (the
checkpoint goes into that folder; the link stays); a folder that cannot be renamed (a
mount point such as a docker volume, tmpfs or NFS export; a folder whose parent is
read-only) is written inside, into ``<path>/.mnb-tmp-<id>``, and its files moved in with
``mnb.json`` last (:func:`mnb.writes.fill`: the old checkpoint stays complete in
``<path>/.mnb-old-<id>`` until then); a target nothing can be written to is refused on
every rank with ``OSError`` before anything is written. A save that fails on any rank
raises the same error on every rank (``OSError`` when the cause was one, else
``RuntimeError``), removes what it wrote and leaves the last checkpoint and the pool usable.

RNG states are saved per (pp, tp) rank and restored only under the same layout.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mnb import writes
from mnb.errors import DamagedCheckpointError
from mnb.megatron import schedule
from mnb.results import LoadResult
from mnb.megatron.checkpoint_fixes import cuda_calls_on_cpu, init_empty_optimizer_state, torch_adam_step_fixes

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILE = "mnb.json"
MEGATRON_META_FILE = "metadata.json"  # dist_checkpointing's: backends of the sharded tensors
_REQUIRED_META = ("format", "step", "layout", "optimizer")  # written by every save since format 1
OPTIMIZER_METADATA = {
    # The distributed optimizer's only format in 0.16 that reshards across tp/pp/dp
    # (the default, 'fully_sharded_model_space', raises "flattened_range is not supported").
    "distrib_optim_sharding_type": "fully_reshardable",
    # Chained optimizers (dense + experts): keys by parameter, not by optimizer index.
    "chained_optim_avoid_prefix": True,
}


# -- small helpers -------------------------------------------------------------------


def _dist():
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise RuntimeError(
            "mnb.save/mnb.load run on pool ranks: torch.distributed is not initialised "
            "(start a pool with %mnb start, or call torch.distributed.init_process_group)"
        )
    return torch.distributed


def _parallel_state():
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "no Megatron parallel layout on this rank: run under %%megatron --tp/--pp, or call "
            "mnb.megatron.layout.apply_layout(ParallelConfig(...)) first"
        )
    return ps


def _layout() -> dict[str, Any]:
    ps = _parallel_state()
    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,  # mnb's spelling: 1, not None
        "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "world_size": torch.distributed.get_world_size(),
    }


def _current_model():
    """The model the last ``mnb.gpt``/``mnb.from_hf`` built on this rank, else a clear error."""
    from mnb.megatron.model import current_model

    found = current_model()
    if found is None:
        raise ValueError("no model given: pass the model, e.g. mnb.save(path, model)")
    return found


def _chunks(model) -> list[torch.nn.Module]:
    """Unwrapped chunks (no DDP / Float16Module) of an mnb model, a list of modules, or a module.

    Unwrapped like Megatron-LM's checkpointing does, so tensor keys are the
    model's own ("decoder.layers.0...") whatever the wrappers.
    """
    from megatron.core.utils import unwrap_model

    if getattr(model, "released", None):  # what mnb.train and the others say, not "expected a model"
        model.check_layout()
    if hasattr(model, "chunks"):
        chunks = list(model.chunks)
    elif isinstance(model, (list, tuple)):
        chunks = list(model)
    elif isinstance(model, torch.nn.Module):
        chunks = [model]
    else:
        raise TypeError(
            f"expected an mnb model, a module or a list of modules, got {type(model).__name__}"
        )
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        # an empty list would save a checkpoint of nothing over a real one
        raise TypeError(f"expected an mnb model, a module or a non-empty list of modules, got {model!r:.80}")
    return unwrap_model(chunks)


def _model_keys(n: int) -> list[str]:
    """Megatron-LM's convention: 'model', or 'model0', 'model1', ... for vpp chunks."""
    return ["model"] if n == 1 else [f"model{i}" for i in range(n)]


def _model_sharded_state_dict(chunks) -> dict:
    return {key: chunk.sharded_state_dict(prefix="") for key, chunk in zip(_model_keys(len(chunks)), chunks)}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    try:
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:  # tracker not initialised: nothing to restore later
        state["tracker"] = None
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("tracker"):
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state: dict | None):
    """One ShardedObject per (pp, tp) coordinate; dp replicas are not written twice."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    ps = _parallel_state()
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject("mnb.rng_state", state, shape, offset,
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _broadcast(obj):
    box = [obj]
    _dist().broadcast_object_list(box, src=0)
    return box[0]


def read_meta(path: str | os.PathLike) -> dict | None:
    """``mnb.json`` of a checkpoint folder, or None when absent or unreadable: readable without torch.

    None only says "not usable here" (:func:`find_checkpoint` skips such folders);
    :func:`load` reads the files again with :func:`_read_json` to say what is wrong.
    """
    try:
        meta = json.loads((Path(path).expanduser() / META_FILE).read_text())
    except (OSError, ValueError):  # missing, a folder, not UTF-8, not JSON
        return None
    return meta if isinstance(meta, dict) else None


def _damaged(folder: Path, name: str, problem: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(f"checkpoint {folder} is damaged: {name} {problem}; re-save it or load another")


def _read_json(folder: Path, name: str) -> dict:
    """The JSON object in ``folder/name``; DamagedCheckpointError saying what is wrong with it."""
    try:
        raw = (folder / name).read_bytes()
    except FileNotFoundError:
        raise _damaged(folder, name, "is missing") from None
    except OSError as exc:
        raise _damaged(folder, name, f"cannot be read ({type(exc).__name__}: {exc.strerror or exc})") from None
    if not raw.strip():
        raise _damaged(folder, name, f"is empty ({len(raw)} bytes)")
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _damaged(folder, name, f"is not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise _damaged(folder, name, f"is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    if not isinstance(data, dict):
        raise _damaged(folder, name, f"holds a JSON {type(data).__name__}, not an object")
    return data


def _read_mnb_meta(folder: Path) -> dict:
    """``mnb.json``, checked for the fields :func:`load` reads."""
    meta = _read_json(folder, META_FILE)
    missing = [key for key in _REQUIRED_META if key not in meta]
    if missing:
        raise _damaged(folder, META_FILE, f"lacks field(s) {', '.join(missing)}")
    version = meta["format"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise _damaged(folder, META_FILE, f"has format {version!r}, not a version number")
    if version > FORMAT_VERSION:
        raise ValueError(f"checkpoint {folder} has format {version}, newer than this mnb reads "
                         f"({FORMAT_VERSION}); upgrade mnb to load it")
    return meta


def _check_megatron_meta(folder: Path) -> None:
    """dist_checkpointing's ``metadata.json``: the fields its ``CheckpointingConfig`` takes."""
    from dataclasses import MISSING, fields

    from megatron.core.dist_checkpointing.core import CheckpointingConfig

    data = _read_json(folder, MEGATRON_META_FILE)
    known = {f.name: f for f in fields(CheckpointingConfig)}
    missing = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING and n not in data]
    if missing:
        raise _damaged(folder, MEGATRON_META_FILE, f"lacks field(s) {', '.join(missing)}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise _damaged(folder, MEGATRON_META_FILE, f"has field(s) {', '.join(unknown)} this Megatron-Core does "
                       "not know (saved by another version?)")


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The complete checkpoint for ``path``: itself, or what an interrupted swap left.

    A save that died between "move the old one aside" and "rename the new one in"
    leaves ``path.tmp-<id>`` (complete: has ``mnb.json``) and ``path.old-<id>``;
    the newer complete one wins (:func:`mnb.writes.find`).
    """
    return writes.find(Path(path).expanduser().absolute(), writes.MNB_CHECKPOINT)


# -- save / load -------------------------------------------------------------------


def save(path: str | os.PathLike, model=None, optimizer=None, *, step: int | None = None,
         extra: dict | None = None, overwrite: bool = False) -> Path:
    """Write a distributed checkpoint of ``model`` (and its optimizer) to ``path``; collective.

    ``model``: the model from ``mnb.gpt`` (its ``.chunks``; its ``.optimizer`` when
    ``optimizer`` is None), a Megatron module, or a list of chunks. ``step`` (default
    ``model.steps_done``) and ``extra`` (JSON-serialisable) go into ``mnb.json``.
    Returns the checkpoint's absolute path.

    ``path`` may be new, empty or an mnb checkpoint (replaced once the new one is complete);
    a folder holding anything else is refused (:class:`~mnb.errors.OverwriteRefusedError`,
    the same on every rank, before anything is written) unless ``overwrite=True``.  Either
    way, entries that are not the checkpoint's own files (a ``notes.txt``, a ``sub/``) stay.
    """
    from megatron.core import dist_checkpointing

    from mnb.megatron import fsdp

    dist = _dist()
    model = _current_model() if model is None else model
    chunks = _chunks(model)
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    sharded = fsdp.sharded_chunks(model)
    if step is None:
        step = getattr(model, "steps_done", None)
    path = Path(path).expanduser().absolute()  # '~/ckpt' is the home folder's, as a shell has it
    rank = dist.get_rank()
    t0 = time.perf_counter()
    # rank 0 decides where and how (a link followed, a mount point written inside) and every rank
    # receives the same plan, or raises the same refusal, before anything is written
    prepared = writes.prepare(path, writes.MNB_CHECKPOINT, overwrite=overwrite, writer="mnb.save") \
        if rank == 0 else None
    plan = writes.agree(_broadcast(prepared))
    tmp = plan.tmp

    error = None
    try:
        with fsdp.whole_parameters(sharded):  # Megatron-FSDP's dp shards gathered: the same layout-free tensors
            state = _model_sharded_state_dict(chunks)
            if optimizer is not None:
                state["optimizer"] = _optimizer_sharded_state_dict(optimizer, state, sharded, is_loading=False)
            state["mnb_rng"] = _rng_sharded_object(_rng_state())
            with cuda_calls_on_cpu():
                dist_checkpointing.save(state, str(tmp))  # ends with a barrier
        meta = {
            "format": FORMAT_VERSION, "step": step, "layout": _layout(),
            "num_chunks": len(chunks), "optimizer": optimizer is not None,
            "optimizer_config": _optimizer_config(optimizer),
            "consumed_samples": getattr(model, "consumed_samples", None),
            "model_config": _model_config(model), "extra": extra or {}, "time": time.time(),
            "schedule": schedule.state(model),  # settings + Megatron's opt_param_scheduler state, or None
        }
        if rank == 0:
            (tmp / (META_FILE + ".part")).write_text(json.dumps(meta, indent=1, default=str))
            os.replace(tmp / (META_FILE + ".part"), tmp / META_FILE)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it at the next collective
        error = exc
    # every rank finished writing (the gather is the barrier); the new checkpoint is complete unless one failed
    _raise_first(path, plan, _gather_errors(dist, error), error)

    if rank == 0:
        try:
            writes.finish(plan, writes.MNB_CHECKPOINT)  # on failure: tmp removed, the old checkpoint in place
        except Exception as exc:  # noqa: BLE001 - broadcast below, raised on every rank
            error = exc
    _raise_first(path, plan, _broadcast(_describe(0, error) if rank == 0 else None), error)
    logger.info("saved %s (step %s) in %.2f s", path, step, time.perf_counter() - t0)
    return path


def _describe(rank: int, error: BaseException | None) -> tuple[int, str, str, bool] | None:
    """An exception as plain data that travels: (rank, name, message, is an OSError)."""
    return None if error is None else (rank, type(error).__name__, str(error), isinstance(error, OSError))


def _gather_errors(dist, error: BaseException | None) -> tuple[int, str, str, bool] | None:
    """The lowest rank's error among every rank's (a collective: every rank must call it), or None."""
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, _describe(dist.get_rank(), error))
    return next((r for r in reports if r is not None), None)


def _raise_first(path: Path, plan, report: tuple[int, str, str, bool] | None, local: BaseException | None) -> None:
    """Raise ``report`` (the same on every rank: an OSError for an OSError, else RuntimeError) after rank 0
    removed what the save wrote; nothing when ``report`` is None."""
    if report is None:
        return
    if _dist().get_rank() == 0:
        writes.discard(plan)
    rank, name, message, is_os = report
    text = f"mnb.save({str(path)!r}) failed on rank {rank}, the last checkpoint is unchanged: {name}: {message}"
    raise (OSError if is_os else RuntimeError)(text) from local


def _optimizer_sharded_state_dict(optimizer, model_state: dict, sharded: list, *, is_loading: bool) -> dict:
    """The optimizer's part of the checkpoint: Megatron's own, or for Megatron-FSDP chunks the
    same ``fully_reshardable`` form built from FSDP's dp shards (:mod:`mnb.megatron.fsdp_optim`)."""
    if sharded:
        from mnb.megatron import fsdp_optim

        return fsdp_optim.sharded_state_dict(optimizer, model_state, sharded, is_loading=is_loading)
    return optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))


def _model_config(model) -> dict | None:
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else None


_OPT_FIELDS = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "clip_grad", "bf16",
               "use_distributed_optimizer")


def _optimizer_config(optimizer) -> dict | None:
    """The Megatron OptimizerConfig fields needed to rebuild the same optimizer."""
    if optimizer is None:
        return None
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    config = getattr(subs[0], "config", None)
    return {f: getattr(config, f, None) for f in _OPT_FIELDS} if config is not None else None


_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                 "ffn_hidden_size", "kv_channels", "vocab_size", "normalization",
                 "gated_linear_unit", "position_embedding_type", "add_bias_linear",
                 "num_moe_experts", "share_embeddings_and_output_weights")


def _check_same_shape(meta: dict, model) -> None:
    """ValueError naming every architecture field that differs from the checkpoint's."""
    saved, mine = meta.get("model_config") or {}, _model_config(model) or {}
    diffs = [f"{k}: checkpoint {saved[k]!r}, model {mine[k]!r}" for k in _SHAPE_FIELDS
             if k in saved and k in mine and saved[k] != mine[k]]
    if diffs:
        raise ValueError("the checkpoint holds a different model (" + "; ".join(diffs) + "); build "
                         "the model with the checkpoint's settings, e.g. mnb.gpt(preset, **settings)")


def _check_same_optimizer(meta: dict, optimizer) -> None:
    saved = (meta.get("optimizer_config") or {}).get("use_distributed_optimizer")
    mine = (_optimizer_config(optimizer) or {}).get("use_distributed_optimizer")
    if saved is not None and mine is not None and bool(saved) != bool(mine):
        raise ValueError(
            f"the checkpoint's optimizer state was saved with use_distributed_optimizer={saved}, "
            f"this model's optimizer has {mine}: train with the same setting, or load the "
            "weights only with mnb.load(path, model, load_optimizer=False)"
        )


def _ensure_optimizer(model, meta: dict):
    """Give a never-trained mnb model its DDP wrappers and optimizer, as mnb.train would.

    So the checkpoint's optimizer state can be loaded now and training continues
    with it (mnb.train keeps an existing optimizer). Uses the optimizer settings
    recorded at save time; the learning-rate schedule is restored after the load (:mod:`mnb.megatron.schedule`).
    """
    saved = meta.get("optimizer_config")
    if getattr(model, "optimizer", None) is not None or not saved or not hasattr(model, "wrapped"):
        return getattr(model, "optimizer", None)
    from mnb.config import TrainConfig
    from mnb.megatron.train import _prepare  # only when a checkpoint's optimizer state needs building
    fields = {k: saved[k] for k in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2",
                                    "clip_grad", "use_distributed_optimizer") if saved.get(k) is not None}
    _prepare(model, TrainConfig(bf16=bool(saved.get("bf16")), **fields))
    return model.optimizer


def _locate(requested: Path) -> tuple[Path, dict]:
    """The folder to load for ``requested`` and its ``mnb.json`` (defaults for a plain Megatron one).

    Raises before any collective, the same on every rank: FileNotFoundError when
    nothing is there, DamagedCheckpointError naming the file and what is wrong with it.
    """
    found = find_checkpoint(requested)
    if found is not None:
        if found != Path(os.path.realpath(requested)):  # a link's target is no interrupted save
            logger.warning("%s was being replaced when a save stopped; loading %s", requested, found)
        meta = _read_mnb_meta(found)
    elif not requested.exists():
        raise FileNotFoundError(f"no checkpoint at {requested}")
    elif not requested.is_dir():
        raise ValueError(f"{requested} is a file, not a checkpoint folder")
    elif (requested / META_FILE).exists():  # find_checkpoint could not use it: say why
        found, meta = requested, _read_mnb_meta(requested)
    elif (requested / MEGATRON_META_FILE).exists():  # a plain Megatron checkpoint
        found, meta = requested, {"step": None, "layout": None, "optimizer": False, "extra": {}}
    else:
        raise ValueError(f"{requested} is not a complete checkpoint (neither {META_FILE} nor "
                         f"{MEGATRON_META_FILE}); was its save interrupted?")
    _check_megatron_meta(found)
    return found, meta


def load(path: str | os.PathLike, model=None, optimizer=None, *, load_optimizer: bool = True,
         load_rng: bool = True, strict: bool = True) -> dict:
    """Load a checkpoint written by :func:`save` into ``model`` (any layout); collective.

    Model weights always; optimizer state when the checkpoint has it and
    ``load_optimizer`` (a never-trained ``mnb.gpt`` model first gets its DDP wrappers
    and optimizer, built as ``mnb.train`` would with the saved settings); RNG
    states when the layout is unchanged and ``load_rng``. Sets ``model.steps_done``
    and ``model.consumed_samples``, and with the optimizer state the learning-rate schedule
    at its step (``model.scheduler``, ``model.train_settings``). Returns ``mnb.json`` plus
    ``path``, ``optimizer_loaded``, ``rng_loaded`` and ``schedule_loaded``. ``strict``: every model tensor must be
    in the checkpoint. A model of another shape raises ValueError naming the fields; a
    folder whose ``mnb.json`` or ``metadata.json`` is missing, truncated, not JSON or
    lacks fields raises :class:`DamagedCheckpointError` naming the folder, the file and
    what is wrong, on every rank before any collective.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    dist = _dist()
    model = _current_model() if model is None else model
    chunks = _chunks(model)
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    found, meta = _locate(Path(path).expanduser().absolute())
    t0 = time.perf_counter()
    _check_same_shape(meta, model)
    from mnb.megatron import fsdp

    fsdp.check_load(model, meta, bool(load_optimizer and meta.get("optimizer")))
    if optimizer is None and load_optimizer and meta.get("optimizer"):
        optimizer = _ensure_optimizer(model, meta)  # under --fsdp: wrapped by Megatron-FSDP now
    use_optimizer = bool(load_optimizer and optimizer is not None and meta.get("optimizer"))
    sharded = fsdp.sharded_chunks(model) if use_optimizer else []
    if use_optimizer:
        _check_same_optimizer(meta, optimizer)
        init_empty_optimizer_state(optimizer)
    saved = meta.get("layout")
    if saved is not None:
        saved = {**saved, "vpp": saved.get("vpp") or 1}  # saves before vpp was always an int wrote None
    use_rng = bool(load_rng and saved == _layout())
    # Megatron's "unexpected" = requested but absent from the checkpoint.
    strictness = StrictHandling.RAISE_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED
    # Megatron-FSDP (an optimizer to load into a model wrapped just now): the raw parameters,
    # whole, are what the model keys describe; its optimizer state is placed after (fsdp_optim.load).
    with fsdp.whole_parameters(sharded):
        state = _model_sharded_state_dict(chunks)
        if use_optimizer:
            state["optimizer"] = _optimizer_sharded_state_dict(optimizer, state, sharded, is_loading=True)
        if use_rng:
            state["mnb_rng"] = _rng_sharded_object(None)
        with cuda_calls_on_cpu():
            loaded = dist_checkpointing.load(state, str(found), strict=strictness)
        for key, chunk in zip(_model_keys(len(chunks)), chunks):
            chunk.load_state_dict(loaded[key], strict=strict)
    if sharded:
        from mnb.megatron import fsdp_optim

        fsdp_optim.load(optimizer, loaded["optimizer"], sharded)  # main weights, then compute weights, too
    elif use_optimizer:
        with torch_adam_step_fixes(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # fp32 main params follow the loaded weights
    if use_rng:
        _set_rng_state(loaded["mnb_rng"])
    for attr, key in (("steps_done", "step"), ("consumed_samples", "consumed_samples")):
        if hasattr(model, attr) and meta.get(key) is not None:
            setattr(model, attr, meta[key])
    # The learning-rate schedule goes with the optimizer state (older checkpoints have none:
    # the next mnb.train starts a schedule as a first call does).
    schedule_loaded = use_optimizer and hasattr(model, "scheduler") and schedule.restore(
        model, meta.get("schedule"), getattr(optimizer, "chained_optimizers", None) or [optimizer])
    if use_optimizer and getattr(model, "use_distributed_optimizer", False) and hasattr(model, "train_settings"):
        # the next mnb.train keeps the optimizer the state went into (an FSDP checkpoint's train calls
        # never named it: under --fsdp it is implied)
        model.train_settings.setdefault("use_distributed_optimizer", True)
    dist.barrier()
    logger.info("loaded %s (step %s) in %.2f s", found, meta.get("step"), time.perf_counter() - t0)
    return LoadResult({**meta, "path": str(found), "optimizer_loaded": use_optimizer, "rng_loaded": use_rng,
                       "schedule_loaded": bool(schedule_loaded)})
