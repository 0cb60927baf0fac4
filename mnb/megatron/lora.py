"""``mnb.lora``: LoRA adapters on Megatron's parallel linears, with peft's semantics, under any layout.

Inside a ``%%megatron --tp 2`` cell, on every rank::

    model = mnb.from_hf("/models/Llama-3.2-1B")
    mnb.lora(model, rank=16, alpha=32, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    mnb.train(model, steps=100, data="notes/")      # only the adapters train (and hold Adam's state)
    mnb.save_adapter("/adapters/notes", model)      # peft's folder: PeftModel.from_pretrained loads it

A projection ``W x`` becomes ``W x + (alpha / rank) * B A dropout(x)`` (Hu et al. 2021), one
adapter per Hugging Face projection as peft has them.  Megatron fuses some of them: ``linear_qkv``
holds q, k and v interleaved per query group, ``linear_fc1`` holds ``[gate_r; up_r]``.  Each
peft adapter keeps its own ``A`` (``[rank, in]``) and ``B`` (``[out, rank]``); ``B``'s rows are
placed in the rows of the fused output its projection owns, found with the same slicing rules
that load the base weights (:mod:`mnb.megatron.hf.rules`), so q_proj alone adapts the q rows only.

Tensor parallelism, as Megatron splits the base weight:

- column-parallel (``linear_qkv``, ``linear_fc1``): ``A`` whole on every tp rank, ``B`` split on
  its output rows.  ``u = A x`` enters the tp region like the base's input (all-reduce of its
  gradient; under sequence parallelism an all-gather of ``u``, ``rank`` wide instead of
  ``hidden`` wide, and ``A``'s gradient summed over tp as Megatron does for norms).
- row-parallel (``linear_proj``, ``linear_fc2``): ``A`` split on its input columns, ``B`` whole;
  ``u = A_r x_r`` is summed over tp (reduce-scattered under sequence parallelism) before ``B``.

The adapter lives on the linear as ``<linear>.lora`` (a :class:`LoraLinear`), applied by a forward
hook; every other parameter is frozen (``requires_grad=False``), so Megatron's DDP and optimizer
hold gradients and Adam's state for the adapters alone.  ``mnb.save``/``mnb.load`` checkpoint
them with their tp sharding (a later layout reads them back); :func:`merge_lora` folds them in.
"""

from __future__ import annotations

import dataclasses
import math
import types
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mnb.config import LORA_ALL, LORA_HF_TARGETS, LORA_MEGATRON_TARGETS, LoraConfig
from mnb.megatron.hf.rules import Rule, read_local

ATTRIBUTE = "lora"
"""The adapter's name on its linear: parameters ``...linear_qkv.lora.A.q_proj``."""


def is_adapter_parameter(name: str) -> bool:
    return f".{ATTRIBUTE}." in f".{name}"


@dataclass(frozen=True)
class Piece:
    """Rows of one Hugging Face ``B`` that this rank holds: ``[hf_start, hf_start + len(positions))``
    of ``B``, placed at ``positions`` of the linear's local output (None: all of them, in order)."""

    key: str
    hf_start: int
    length: int
    positions: torch.Tensor | None


@dataclass(frozen=True)
class Target:
    """One peft adapter (one HF projection) on a Megatron linear."""

    hf_module: str
    """``model.layers.0.self_attn.q_proj``: peft's module name."""
    short: str
    in_features: int
    out_features: int
    pieces: tuple[Piece, ...]


class LoraLinear(torch.nn.Module):
    """The adapters of one Megatron linear (``kind`` ``column`` or ``row``): ``A[short]``, ``B[piece]``."""

    def __init__(self, kind: str, targets: list[Target], lora: LoraConfig, tp: int, tp_rank: int,
                 sequence_parallel: bool, tp_group, seed: int, device, dtype) -> None:
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.kind, self.targets, self.config = kind, targets, lora
        self.scale = lora.scale
        self.tp, self.tp_group = tp, tp_group
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        self._on_device: dict[tuple[str, str], torch.Tensor] = {}
        r = lora.rank
        for t in targets:
            a = initial_a(r, t.in_features, seed, t.hf_module)
            if kind == "row":
                n = t.in_features // tp
                a = a[:, tp_rank * n:(tp_rank + 1) * n]
            self.A[t.short] = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
            for piece in t.pieces:
                rows = t.out_features if kind == "row" else piece.length
                self.B[piece.key] = torch.nn.Parameter(torch.zeros(rows, r, device=device, dtype=dtype))
        # A is split over tp where the base weight's input is (row), B where its output is (column); the other
        # is whole on every rank.  (By role, not by key: a one-piece target's B has its A's key.)
        roles = [(param, kind == "row") for param in self.A.values()]
        roles += [(param, kind == "column") for param in self.B.values()]
        for param, sharded in roles:
            if sharded and tp > 1:
                set_tensor_model_parallel_attributes(param, True, 1 if kind == "row" else 0, 1)
            elif sequence_parallel:
                param.sequence_parallel = True  # its gradient is partial over the sequence: summed over tp

    def u(self, x: torch.Tensor, short: str, sp: bool) -> torch.Tensor:
        """``A x`` where ``B`` applies it: the whole sequence (column) or this rank's output rows (row).
        ``sp``: the linear's input (column) or output (row) is split over the sequence."""
        from megatron.core import tensor_parallel as tpl

        u = F.linear(self.dropout(x), self.A[short])
        if self.kind == "column":
            if sp:
                return tpl.gather_from_sequence_parallel_region(u, group=self.tp_group)
            return tpl.copy_to_tensor_model_parallel_region(u, group=self.tp_group) if self.tp > 1 else u
        if sp:
            return tpl.reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group)
        return tpl.reduce_from_tensor_model_parallel_region(u, group=self.tp_group) if self.tp > 1 else u

    def forward(self, x: torch.Tensor, out: torch.Tensor, sp: bool = False) -> torch.Tensor:
        for t in self.targets:
            u = self.u(x, t.short, sp and self.tp > 1)
            for piece in t.pieces:
                delta = F.linear(u, self.B[piece.key]) * self.scale
                if piece.positions is None:
                    out = out + delta
                else:
                    out = _AddAt.apply(out, self.positions(piece, out.device), delta.to(out.dtype))
        return out

    def positions(self, piece: Piece, device) -> torch.Tensor:
        """``piece.positions`` on ``device``, copied once (a copy from host memory at every call would
        wait for the GPU's queue, once per projection and microbatch)."""
        key = (piece.key, str(device))
        cached = self._on_device.get(key)
        if cached is None:
            cached = self._on_device[key] = piece.positions.to(device)
        return cached

    @torch.no_grad()
    def delta_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """``scale * B A`` in the layout of this rank's base ``weight`` (fp32)."""
        delta = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for t in self.targets:
            a = self.A[t.short].float()
            for piece in t.pieces:
                part = self.scale * (self.B[piece.key].float() @ a)
                if piece.positions is None:
                    delta += part
                else:
                    delta.index_add_(0, self.positions(piece, delta.device), part)
        return delta

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Megatron dist-checkpoint entries: sharded ``B`` (column) / ``A`` (row) keep their tp axis."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        if self.kind == "column":
            axes = {f"B.{key}": 0 for key in self.B}
        else:
            axes = {f"A.{key}": 1 for key in self.A}
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets)


class _AddAt(torch.autograd.Function):
    """``out.index_add(last dim, positions, delta)`` whose backward keeps only ``positions``.

    torch's ``index_add`` saves ``delta`` for its backward (``IndexAddBackward0._saved_source``): one
    ``[tokens, out]`` tensor per adapted projection inside a fused linear (q, k, v in ``linear_qkv``;
    gate, up in ``linear_fc1``), held from forward to backward: 9.1 GiB more activations than full
    fine-tuning on a Llama-3.2-3B shape at 8k tokens per microbatch (H200, 2026-12-03).  Its gradient
    needs only the positions: ``grad`` for ``out``, ``grad[..., positions]`` for ``delta``.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, positions: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(positions)
        return out.index_add(out.dim() - 1, positions, delta)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (positions,) = ctx.saved_tensors
        delta = grad.index_select(grad.dim() - 1, positions) if ctx.needs_input_grad[2] else None
        return grad if ctx.needs_input_grad[0] else None, None, delta


def initial_a(rank: int, in_features: int, seed: int, name: str) -> torch.Tensor:
    """peft's ``A``: ``kaiming_uniform_(a=sqrt(5))`` on ``[rank, in]``, i.e. ``U(-1/sqrt(in), 1/sqrt(in))``;
    drawn whole from a generator seeded by the model's seed and the projection's name, so every
    layout starts from the same adapters."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return torch.empty(rank, in_features).uniform_(-bound, bound, generator=generator)


# -- which linears, which rows ----------------------------------------------------------------


class _Rows:
    """A reader of index tensors: what :func:`read_local` places on this rank is ``tensor * 2**32 + row``."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.codes = {name: torch.arange(n, dtype=torch.int64) + (i << 32) for i, (name, n) in enumerate(sizes.items())}

    def slice(self, key: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.codes[key][start:stop]


def local_rows(rule: Rule, tp: int, tp_rank: int, heads) -> list[tuple[int, int]]:
    """(HF tensor index, HF row) of each output row of this rank's part of a column-kind ``rule``."""
    import dataclasses

    out_sizes = [shape[1] if rule.transposed else shape[0] for shape in rule.shapes]
    flat = dataclasses.replace(rule, shapes=tuple((n,) for n in out_sizes), transposed=False)
    reader = _Rows(dict(zip(rule.hf, out_sizes)))
    local_n = sum(out_sizes) // tp
    codes = read_local(flat, reader, (local_n,), tp, tp_rank, vocab_size=0, heads=heads)
    return [(int(c) >> 32, int(c) & 0xFFFFFFFF) for c in codes]


def _pieces(short: str, rows: list[tuple[int, int]], index: int, offset: int) -> list[Piece]:
    """Runs of consecutive HF rows of tensor ``index`` among this rank's rows ``rows`` (one piece each)."""
    found = sorted(((pos, row) for pos, (i, row) in enumerate(rows) if i == index), key=lambda f: f[1])
    runs: list[list[tuple[int, int]]] = []
    for pos, row in found:
        if runs and row == runs[-1][-1][1] + 1:
            runs[-1].append((pos, row))
        else:
            runs.append([(pos, row)])
    all_rows = len(found) == len(rows) and all(p == k for k, (p, _) in enumerate(found))  # in order
    out = []
    for k, run in enumerate(runs):
        positions = None if all_rows and len(runs) == 1 else torch.tensor([p for p, _ in run], dtype=torch.long)
        out.append(Piece(short if len(runs) == 1 else f"{short}_{k}", offset + run[0][1], len(run), positions))
    return out


def module_targets(rule: Rule, kind: str, wanted: set[str], megatron_name: str, tp: int, tp_rank: int,
                   heads) -> list[Target]:
    """The peft adapters ``wanted`` asks for on the linear ``rule`` describes."""
    whole = megatron_name in wanted
    hf_modules = [name.rsplit(".", 1)[0] for name in rule.hf]
    shapes = [tuple(reversed(s)) if rule.transposed else s for s in rule.shapes]  # Megatron's [out, in]
    targets = []
    rows = local_rows(rule, tp, tp_rank, heads) if kind == "column" else None
    for i, (module, shape) in enumerate(zip(hf_modules, shapes)):
        short = module.rsplit(".", 1)[1]
        if not whole and short not in wanted:
            continue
        out_features, in_features = shape
        if kind == "column":
            pieces = _pieces(short, rows, i, 0)
        else:
            pieces = [Piece(short, 0, out_features, None)]
        targets.append(Target(module, short, in_features, out_features, tuple(pieces)))
    return targets


LINEARS = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row"}


def linears(model):
    """(chunk, module path, module, canonical weight name, kind) of every adaptable linear of this rank."""
    from mnb.megatron.hf.load import canonical_names

    for chunk in model.chunks:
        canon = canonical_names(chunk)
        for path, module in chunk.named_modules():
            last = path.rsplit(".", 1)[-1]
            if last in LINEARS and f"{path}.weight" in canon:
                yield chunk, path, module, canon[f"{path}.weight"], LINEARS[last]


def rules_of(model) -> tuple[dict[str, Rule], bool]:
    """The model's Megatron -> Hugging Face rules, and whether it is GPT-2-like (Conv1D names)."""
    from mnb.megatron.hf import gpt2, llama
    from mnb.megatron.hf.load import family_tensors
    from mnb.hf_config import architecture, to_hf_config

    source = getattr(model, "hf", None)
    try:  # the source's architecture, or the one mnb.save_hf would write
        arch = architecture(source.config if source is not None else to_hf_config(model.config), "config.json")
    except ValueError:  # an mnb.gpt model no Hugging Face architecture describes: names for slicing only
        arch = "GPT2LMHeadModel" if not model.config.gated_linear_unit else "LlamaForCausalLM"
    cfg = model.config
    if arch == "GPT2LMHeadModel" and not cfg.gated_linear_unit:
        return gpt2.tensors(cfg), True
    return (family_tensors(arch, cfg) if arch != "GPT2LMHeadModel" else llama.tensors(cfg)), False


# -- the public calls ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraSummary:
    """What :func:`mnb.lora` did: trainable and total parameters of the whole model (every rank's share)."""

    trainable: int
    total: int
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    def __repr__(self) -> str:
        return (f"LoRA r={self.rank} alpha={self.alpha:g} on {', '.join(self.targets)}: "
                f"{self.trainable:,} trainable of {self.total:,} parameters ({100 * self.fraction:.2f} %)")

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(repr(self))


def adapters(model) -> list[tuple[torch.nn.Module, LoraLinear]]:
    """(linear, adapter) pairs of this rank's chunks."""
    return [(m, getattr(m, ATTRIBUTE)) for chunk in model.chunks for m in chunk.modules()
            if isinstance(getattr(m, ATTRIBUTE, None), LoraLinear)]


def lora(model, *, rank: int = 8, alpha: float = 16, dropout: float = 0.0, targets=None) -> LoraSummary:
    """Add LoRA adapters to ``model``'s projections ``targets`` and freeze every other weight.

    ``targets``: Hugging Face names (``q_proj`` ... ``down_proj``; GPT-2's ``c_attn``, ``c_proj``,
    ``c_fc``), Megatron's (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) or
    ``"all-linear"``; default peft's (``q_proj``, ``v_proj``; GPT-2's ``c_attn``).  Call it on
    every rank, before the model's first ``mnb.train``.  Returns the trainable and total
    parameter counts of the whole model (:class:`LoraSummary`).  ValueError, the same on every
    rank, for a target this model has not (or MoE experts), a model already trained or adapted.
    """
    config = LoraConfig(rank=rank, alpha=alpha, dropout=dropout,
                        targets=tuple(targets) if isinstance(targets, (list, tuple)) else targets)
    return apply(model, config)


def apply(model, config: LoraConfig, only: dict[str, set[str]] | None = None) -> LoraSummary:
    """:func:`lora` with a :class:`LoraConfig`; ``only``: canonical weight name -> HF shorts (load_adapter)."""
    from megatron.core import parallel_state as ps

    from mnb.megatron.hf.load import heads_of

    model.check_layout()
    if adapters(model):
        raise ValueError("this model has LoRA adapters already; mnb.merge_lora(model) folds them into its "
                         "weights first, or build the model again")
    if model.wrapped is not None:
        raise ValueError("mnb.lora goes before the model's first mnb.train (its DDP and optimizer hold every "
                         "weight now); build the model again (or mnb.save_hf / mnb.from_hf) and add the adapters")
    rules, gpt2 = rules_of(model)
    every_name = _target_names(rules)  # the whole model's (a stage may hold none of a target)
    wanted = set(config.resolved_targets(gpt2))
    if config.targets and LORA_ALL in config.targets:  # peft's "all-linear": this model's projections, HF names
        wanted = {n for n in every_name if n in LORA_HF_TARGETS}
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    heads = heads_of(model.config)
    found: set[str] = set()
    plans = []
    for chunk, path, module, canon, kind in linears(model):
        rule = rules.get(canon)
        if rule is None:
            continue
        want = only.get(canon, set()) if only is not None else wanted
        if not want:
            continue
        names = {n.rsplit(".", 1)[0].rsplit(".", 1)[1] for n in rule.hf} | {path.rsplit(".", 1)[-1]}
        hit = want & names
        if not hit:
            continue
        if rule.expert or getattr(module, "is_expert", False):
            raise ValueError(f"LoRA on MoE experts ({canon}) is not supported; target the attention "
                             "projections (q_proj, k_proj, v_proj, o_proj or linear_qkv, linear_proj)")
        found |= hit
        plans.append((module, kind, module_targets(rule, kind, want, path.rsplit(".", 1)[-1], tp, tp_rank, heads)))
    absent = sorted(t for t in wanted if t not in every_name) if only is None else []
    if absent:
        raise ValueError(f"this model ({model.config.name}) has no projection {absent[0]!r}; its projections are "
                         f"{', '.join(sorted(every_name))}")
    for param in (p for chunk in model.chunks for p in chunk.parameters()):
        param.requires_grad_(False)
    for module, kind, targets in plans:
        weight = module.weight
        adapter = LoraLinear(kind, targets, config, tp, tp_rank, bool(getattr(module, "sequence_parallel", False))
                             and tp > 1, getattr(module, "tp_group", None), model.seed, weight.device, weight.dtype)
        module.add_module(ATTRIBUTE, adapter)
        module._lora_hook = module.register_forward_hook(_hook)
        module.sharded_state_dict = types.MethodType(_sharded_state_dict_with_adapter, module)
    if only is None:
        config = dataclasses.replace(config, targets=tuple(sorted(wanted)))
    model.lora = config
    return summary(model, config)


def _target_names(rules: dict[str, Rule]) -> set[str]:
    names = set()
    for canon, rule in rules.items():
        last = canon.rsplit(".", 2)
        if len(last) == 3 and last[1] in LINEARS and last[2] == "weight" and not rule.expert:
            names.add(last[1])
            names |= {n.rsplit(".", 1)[0].rsplit(".", 1)[1] for n in rule.hf}
    return names & (set(LORA_HF_TARGETS) | set(LORA_MEGATRON_TARGETS))


def _hook(module, args, output):
    """The linear's output plus its adapters', split over the sequence when the linear is now (the
    flag is read per call: ``mnb.generate`` switches sequence parallelism off for its calls)."""
    out, bias = output
    return module.lora(args[0], out, bool(getattr(module, "sequence_parallel", False))), bias


def _sharded_state_dict_with_adapter(self, prefix: str = "", sharded_offsets=(), metadata=None):
    state = type(self).sharded_state_dict(self, prefix, sharded_offsets, metadata)
    state.update(self.lora.sharded_state_dict(f"{prefix}{ATTRIBUTE}.", sharded_offsets, metadata))
    return state


def summary(model, config: LoraConfig) -> LoraSummary:
    """Trainable and total parameters of the whole model, as Hugging Face and peft count them (the
    checkpoint's tensors, vocabulary unpadded, a tied embedding once, plus the adapters): the same
    under every layout.  One all-reduce of the adapters' size over the pipeline stages."""
    from megatron.core import parallel_state as ps

    from mnb.megatron.hf.load import expected_tensors

    rules, _ = rules_of(model)
    base = sum(math.prod(shape) for shape in expected_tensors(rules).values())
    first = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0 \
        and ps.get_context_parallel_rank() == 0
    mine = sum(config.rank * (t.in_features + t.out_features) for _, a in adapters(model) for t in a.targets)
    device = next(model.chunks[0].parameters()).device if model.chunks else torch.device("cpu")
    count = torch.tensor([float(mine if first else 0)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(count)
    trainable = int(count.item())
    shorts = tuple(config.targets) if config.targets else config.resolved_targets(False)
    return LoraSummary(trainable, base + trainable, config.rank, config.alpha, shorts)


@torch.no_grad()
def merged_weights(model) -> dict[int, torch.Tensor]:
    """id(base weight) -> this rank's weight with its adapters folded in (fp32), for :func:`mnb.save_hf`."""
    return {id(m.weight): m.weight.detach().float() + a.delta_weight(m.weight) for m, a in adapters(model)}


@torch.no_grad()
def merge_lora(model) -> int:
    """Fold every adapter into its weight (``W += alpha / rank * B A``) and remove it; returns how many.

    Afterwards the model is a plain one again: every weight trainable.  A model trained with
    adapters drops its DDP wrapper and optimizer (they held the adapters only): the next
    ``mnb.train`` trains every weight with a fresh Adam.  Call it on every rank.
    """
    model.check_layout()
    pairs = adapters(model)
    for module, adapter in pairs:
        module.weight.add_(adapter.delta_weight(module.weight).to(module.weight.dtype))
        module._lora_hook.remove()
        del module._lora_hook
        del module._modules[ATTRIBUTE]
        del module.sharded_state_dict  # the instance's override: the class's method again
    if pairs or getattr(model, "lora", None) is not None:
        for param in (p for chunk in model.chunks for p in chunk.parameters()):
            param.requires_grad_(True)
        if model.wrapped is not None:
            model.wrapped, model.optimizer, model.scheduler = None, None, None
            model.precision = model.use_distributed_optimizer = None
    model.lora = None
    return len(pairs)
