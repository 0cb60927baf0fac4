"""peft's LoRA folders in and out of any layout: ``mnb.save_adapter``, ``mnb.load_adapter``.

Inside ``%%megatron`` cells, on every rank::

    mnb.lora(model, rank=16, targets=("q_proj", "v_proj")); mnb.train(model, steps=100, data="notes/")
    mnb.save_adapter("/adapters/notes", model)     # adapter_config.json + adapter_model.safetensors
    model = mnb.from_hf("/models/Llama-3.2-1B")    # later, under any layout
    mnb.load_adapter(model, "/adapters/notes")     # or a folder peft's save_pretrained wrote

In transformers + peft: ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
"/adapters/notes")`` gives the same logits.  The folder is peft's: ``adapter_config.json``
(``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules`` ...) and
``adapter_model.safetensors`` whose keys are
``base_model.model.<HF module>.lora_A.weight`` (``[r, in]``) and ``...lora_B.weight`` (``[out, r]``).
Each tensor is assembled once (the tp ranks of the first data-parallel replica gather their
slices); rank 0 writes the folder atomically (:mod:`mnb.writes`).  Reading checks the whole folder
against the model from the files alone, so a bad one is refused alike on every rank before
anything changes.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import torch

from mnb import writes
from mnb.config import LoraConfig

logger = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")


def _broadcast(obj):
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _tp_gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def _full_tensors(model) -> dict[str, torch.Tensor]:
    """peft key -> whole tensor (fp32, CPU) of every adapter on this rank's stage (collective over tp)."""
    from megatron.core import parallel_state as ps

    from mnb.megatron.lora import adapters

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    out = {}
    for _, adapter in adapters(model):
        for t in adapter.targets:
            a = adapter.A[t.short].detach().float()
            if adapter.kind == "row":
                a, b = _tp_gather(a, 1), adapter.B[t.short].detach().float()
            else:
                b = torch.zeros(t.out_features, adapter.config.rank, dtype=torch.float32, device=a.device)
                for piece in t.pieces:
                    start = piece.hf_start - tp_rank * piece.length  # the tp ranks hold consecutive rows
                    b[start:start + piece.length * tp] = _tp_gather(adapter.B[piece.key].detach().float(), 0)
            prefix = f"base_model.model.{t.hf_module}"
            out[f"{prefix}.lora_A.weight"] = a.cpu().contiguous()
            out[f"{prefix}.lora_B.weight"] = b.cpu().contiguous()
    return out


def adapter_config(model, targets: list[str]) -> dict:
    """peft's ``adapter_config.json`` for ``model``'s adapters."""
    lora = model.lora
    source = getattr(model, "hf", None)
    gpt2 = any(t in ("c_attn", "c_fc") for t in targets) or (
        source is not None and "GPT2LMHeadModel" in (source.config.get("architectures") or []))
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "target_modules": sorted(targets), "bias": "none",
        "fan_in_fan_out": gpt2, "init_lora_weights": True, "inference_mode": True, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
        "base_model_name_or_path": source.folder if source is not None else None,
    }


def save_adapter(path: str | os.PathLike, model, *, overwrite: bool = False) -> Path:
    """Write ``model``'s LoRA adapters (any layout) as a peft folder at ``path``; returns its absolute path.

    Collective: every rank calls it.  ``path`` may be new, empty or an adapter folder (replaced
    once the new one is complete); anything else is refused unless ``overwrite=True``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mnb.megatron.lora import adapters

    model.check_layout()
    if getattr(model, "lora", None) is None:
        raise ValueError("this model has no LoRA adapters: add them with mnb.lora(model, ...) or "
                         "mnb.load_adapter(model, folder) first")
    path = Path(path).expanduser().absolute()
    rank = dist.get_rank()
    prepared = writes.prepare(path, writes.PEFT_ADAPTER, overwrite=overwrite, writer="mnb.save_adapter") \
        if rank == 0 else None
    plan = writes.agree(_broadcast(prepared))  # the same on every rank, before anything is written
    tmp = plan.tmp
    tensors = _full_tensors(model)
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0 \
        and ps.get_context_parallel_rank() == 0
    shorts = sorted({t.short for _, a in adapters(model) for t in a.targets})
    mine = (tensors if writer else {}, shorts)
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    error = None
    if rank == 0:
        try:
            everything = {k: v for part, _ in gathered for k, v in part.items()}
            targets = sorted({s for _, names in gathered for s in names})
            from safetensors.torch import save_file

            save_file(dict(sorted(everything.items())), str(tmp / WEIGHTS), metadata={"format": "pt"})
            (tmp / f"{CONFIG}.part").write_text(json.dumps(adapter_config(model, targets), indent=2, sort_keys=True))
            os.replace(tmp / f"{CONFIG}.part", tmp / CONFIG)  # last: the folder is complete
            writes.finish(plan, writes.PEFT_ADAPTER)
        except Exception as exc:  # noqa: BLE001 - every rank hears of it
            writes.discard(plan)
            error = f"{type(exc).__name__}: {exc}"
    error = _broadcast(error)
    if error:
        raise RuntimeError(f"mnb.save_adapter({str(path)!r}) failed, nothing was written: {error}")
    return path


# -- reading ------------------------------------------------------------------------------------


def _module_map(model) -> dict[str, tuple[str, str, tuple[int, int]]]:
    """HF module name -> (canonical Megatron weight, HF short name, Megatron [out, in]) of every projection."""
    from mnb.megatron.lora import LINEARS, rules_of

    rules, _ = rules_of(model)
    out = {}
    for canon, rule in rules.items():
        parts = canon.rsplit(".", 2)
        if len(parts) != 3 or parts[1] not in LINEARS or parts[2] != "weight" or rule.expert:
            continue
        for hf, shape in zip(rule.hf, rule.shapes):
            module = hf.rsplit(".", 1)[0]
            out[module] = (canon, module.rsplit(".", 1)[1], tuple(reversed(shape)) if rule.transposed else shape)
    return out


def read_folder(path: str | os.PathLike, model) -> tuple[LoraConfig, dict[str, dict[str, set[str]]], Path, dict]:
    """Check a peft LoRA folder against ``model`` from its files alone: (settings, canonical -> HF shorts,
    weights file, HF module -> (A shape, B shape)).  ValueError naming the file and what is wrong."""
    folder = Path(path).expanduser()
    config_file, weights = folder / CONFIG, folder / WEIGHTS
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder; give the adapter folder (with {CONFIG} and {WEIGHTS})")
    if not config_file.is_file():
        raise ValueError(f"{config_file} is missing: {folder} is not a peft adapter folder")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file} is not JSON ({exc}); fix or replace it") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise ValueError(f"{config_file}: peft_type is {config.get('peft_type') if isinstance(config, dict) else None!r}; "
                         "mnb.load_adapter reads LoRA adapters (peft_type 'LORA')")
    for key, bad, why in (("use_dora", True, "DoRA"), ("use_rslora", True, "rsLoRA's alpha/sqrt(r) scaling")):
        if config.get(key) == bad:
            raise ValueError(f"{config_file}: {key} is true; mnb's adapters do not do {why}")
    if config.get("target_parameters"):  # peft's "all-linear" on Mixtral adds these (and a rank_pattern for them)
        raise ValueError(f"{config_file}: target_parameters is {config['target_parameters']!r}: the adapter trains "
                         "parameters outside the projections (MoE experts' weights, as peft's target_modules="
                         "'all-linear' does for Mixtral); mnb's adapters cover the attention and dense MLP "
                         "projections: make it with target_modules naming those (e.g. q_proj, k_proj, v_proj, o_proj)")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            raise ValueError(f"{config_file}: {key} is {config[key]!r}; mnb.load_adapter reads adapters with one "
                             "rank and alpha on whole projections (no per-module patterns or saved modules)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise ValueError(f"{config_file}: bias is {config.get('bias')!r}; mnb's adapters have no biases ('none')")
    r, alpha = config.get("r"), config.get("lora_alpha")
    try:
        settings = LoraConfig(rank=r, alpha=alpha, dropout=float(config.get("lora_dropout") or 0.0))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{config_file}: {exc}") from None
    modules = _module_map(model)
    names = sorted({short for _, short, _ in modules.values()})
    listed = config.get("target_modules")
    if isinstance(listed, list):
        # peft matches an entry by the module name's ending: a short name, or a full path (peft's expansion of
        # "all-linear" writes paths such as model.layers.0.mlp.down_proj); the weights file says which modules
        unknown = [t for t in listed if t.rsplit(".", 1)[-1] not in names and t != "all-linear"]
        if unknown:
            raise ValueError(f"{config_file}: unknown target module {unknown[0]!r} for this model "
                             f"({model.config.name}); its projections are {', '.join(names)}")
    if not weights.is_file():
        other = [p.name for p in folder.glob("adapter_model*")]
        hint = f" (it has {', '.join(other)}: save it with safe_serialization=True)" if other else ""
        raise ValueError(f"{weights} is missing: the adapter's weights file{hint}")
    from safetensors import safe_open

    try:
        handle = safe_open(str(weights), framework="pt")
        shapes = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
        raise ValueError(f"{weights} is not a readable safetensors file ({exc})") from None
    found: dict[str, dict[str, tuple]] = {}
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{weights}: {key} is not a LoRA weight mnb reads "
                             "(base_model.model.<module>.lora_A.weight / lora_B.weight)")
        found.setdefault(match["module"], {})[match["ab"]] = shape
    if not found:
        raise ValueError(f"{weights} holds no LoRA weights")
    only: dict[str, set[str]] = {}
    for module, ab in sorted(found.items()):
        if module not in modules:
            raise ValueError(f"{weights}: unknown target module {module} (not a projection of this model, "
                             f"{model.config.name}: {', '.join(names)})")
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{weights}: {module} has lora_{next(iter(ab))} but no lora_{'B' if 'A' in ab else 'A'}")
        canon, short, (out_f, in_f) = modules[module]
        a, b = ab["A"], ab["B"]
        if a[0] != r or b[1] != r:
            raise ValueError(f"{weights}: rank mismatch: {module}.lora_A is {list(a)} and lora_B {list(b)}, "
                             f"but {CONFIG} says r={r}")
        if a != (r, in_f) or b != (out_f, r):
            raise ValueError(f"{weights}: {module}.lora_A is {list(a)} and lora_B {list(b)}; this model's "
                             f"{short} needs {[r, in_f]} and {[out_f, r]} (an adapter for another model)")
        only.setdefault(canon, set()).add(short)
    targets = tuple(sorted({s for shorts in only.values() for s in shorts}))
    settings = LoraConfig(rank=settings.rank, alpha=settings.alpha, dropout=settings.dropout, targets=targets)
    return settings, only, weights, found


@torch.no_grad()
def load_adapter(model, path: str | os.PathLike):
    """Read the peft LoRA folder ``path`` (made by peft or :func:`save_adapter`) into ``model``, any layout.

    A model without adapters gets them (as :func:`mnb.lora` would, with the folder's rank, alpha
    and modules; every other weight frozen); a model with the same adapters has their values
    replaced.  Returns the parameter counts (:class:`mnb.megatron.lora.LoraSummary`).  Call it on
    every rank.  ValueError, the same on every rank and naming the file, for a missing
    ``adapter_config.json`` or weights file, an unknown target module, a rank or shape that does
    not match, DoRA / rsLoRA / per-module patterns; the model is left as it was.
    """
    from megatron.core import parallel_state as ps
    from safetensors import safe_open

    from mnb.megatron import lora as _lora

    model.check_layout()
    settings, only, weights, found = read_folder(path, model)
    present = _lora.adapters(model)
    if present:
        have = {t.hf_module for _, a in present for t in a.targets}
        mine = {m for m in found if m in have}
        config = model.lora
        stage_modules = _stage_modules(model, only)
        if config.rank != settings.rank or have != stage_modules or mine != have:
            raise ValueError(f"{weights}: this model has other LoRA adapters (r={config.rank} on "
                             f"{', '.join(config.targets or ())}) than the folder's (r={settings.rank} on "
                             f"{', '.join(settings.targets)}); mnb.merge_lora(model) or a fresh model first")
        model.lora = settings
        for _, adapter in present:
            adapter.scale = settings.scale
    else:
        _lora.apply(model, settings, only=only)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    handle = safe_open(str(weights), framework="pt")
    for _, adapter in _lora.adapters(model):
        for t in adapter.targets:
            key = f"base_model.model.{t.hf_module}.lora_%s.weight"
            a = handle.get_tensor(_key(handle, key % "A"))
            b = handle.get_tensor(_key(handle, key % "B"))
            if adapter.kind == "row":
                n = t.in_features // tp
                adapter.A[t.short].copy_(a[:, tp_rank * n:(tp_rank + 1) * n])
                adapter.B[t.short].copy_(b)
            else:
                adapter.A[t.short].copy_(a)
                for piece in t.pieces:
                    adapter.B[piece.key].copy_(b[piece.hf_start:piece.hf_start + piece.length])
    return _lora.summary(model, model.lora)


def _key(handle, key: str) -> str:
    if key in handle.keys():
        return key
    return key.replace(".weight", ".default.weight")


def _stage_modules(model, only: dict[str, set[str]]) -> set[str]:
    """The HF modules of ``only`` whose Megatron linear is on this rank."""
    from mnb.megatron.lora import linears

    here = {canon for _, _, _, canon, _ in linears(model)}
    modules = _module_map(model)
    return {m for m, (canon, short, _) in modules.items() if canon in here and short in only.get(canon, set())}
