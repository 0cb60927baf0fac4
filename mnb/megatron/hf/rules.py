"""How one Megatron parameter is made of Hugging Face tensors, and back.

A :class:`Rule` names the HF tensors behind one Megatron parameter and how they are split
over tensor parallelism.  :func:`read_local` builds this rank's slice from only the rows or
columns it needs (``reader.slice(name, dim, start, stop)``: :mod:`.load` calls it once on
meta tensors to learn which slices, then on the slices staged on the rank's device);
:func:`hf_pieces` turns every tp rank's local tensor back into the HF tensors (the inverse,
applied once per tensor on the writer).

Kinds (shapes in Megatron's orientation, ``[out, in]``):

- ``full``: the same tensor on every tp rank (norms, router, replicated biases, positions).
- ``vocab``: rows split over tp after padding the vocabulary to Megatron's multiple; rows past
  the checkpoint's vocabulary are zeros and never leave :func:`mnb.logits`.
- ``column`` / ``row``: split on the output / input dimension (ColumnParallel / RowParallel).
- ``gated``: SwiGLU's fc1 = ``[gate_r; up_r]`` on tp rank r (each half split like ``column``).
- ``qkv``: Megatron's fused ``linear_qkv``: per query group ``[its q heads | k | v]``, groups split
  over tp; from separate q/k/v tensors (Llama) or GPT-2's fused ``c_attn`` (``q | k | v``).

``transposed``: the checkpoint stores ``[in, out]`` (GPT-2's Conv1D).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rule:
    kind: str
    hf: tuple[str, ...]
    """HF tensor names: one, or (gate, up) for ``gated``, (q, k, v) or (c_attn,) for ``qkv``."""
    shapes: tuple[tuple[int, ...], ...]
    """Their full shapes as stored in the checkpoint."""
    transposed: bool = False
    expert: bool = False
    """An expert's weight: split over the expert tensor-parallel group, placed by ep."""


@dataclass(frozen=True)
class Heads:
    """Attention shape for the ``qkv`` kind."""

    heads: int
    groups: int
    head_dim: int

    @property
    def per_group(self) -> int:
        return self.heads // self.groups


def _mshape(rule: Rule, i: int = 0) -> tuple[int, ...]:
    shape = rule.shapes[i]
    return tuple(reversed(shape)) if rule.transposed and len(shape) == 2 else shape


def _read(reader, rule: Rule, i: int, dim: int, start: int, stop: int, name: str | None = None) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) ``[start, stop)`` of HF tensor ``i`` in Megatron's orientation."""
    name = name or rule.hf[i]
    two_d = len(rule.shapes[i]) == 2
    stored_dim = (1 - dim) if (rule.transposed and two_d) else dim
    part = reader.slice(name, stored_dim, start, stop)
    return part.t() if rule.transposed and two_d else part


def read_local(rule: Rule, reader, local_shape: tuple[int, ...], tp: int, r: int, vocab_size: int,
               heads: Heads | None = None) -> torch.Tensor:
    """This tp rank's part of the Megatron parameter ``rule`` describes (shape ``local_shape``)."""
    kind = rule.kind
    if kind == "full":
        full = _mshape(rule)
        return _read(reader, rule, 0, 0, 0, full[0])
    if kind == "vocab":
        rows = local_shape[0]
        start, stop = r * rows, min((r + 1) * rows, vocab_size)
        if stop <= start:  # only Megatron's padding rows on this rank
            return torch.zeros(local_shape, dtype=torch.float32, device=reader.device)
        part = _read(reader, rule, 0, 0, start, stop)
        if stop - start == rows:
            return part
        out = torch.zeros(local_shape, dtype=part.dtype, device=part.device)
        out[: stop - start] = part
        return out
    if kind in ("column", "row"):
        dim = 0 if kind == "column" else 1
        n = _mshape(rule)[dim] // tp
        return _read(reader, rule, 0, dim, r * n, (r + 1) * n)
    if kind == "gated":
        n = _mshape(rule, 0)[0] // tp
        return torch.cat([_read(reader, rule, i, 0, r * n, (r + 1) * n) for i in (0, 1)])
    if kind == "qkv":
        h = heads
        g0, g1 = r * h.groups // tp, (r + 1) * h.groups // tp
        qn, kn = h.per_group * h.head_dim, h.head_dim
        if len(rule.hf) == 3:
            q = _read(reader, rule, 0, 0, g0 * qn, g1 * qn)
            k = _read(reader, rule, 1, 0, g0 * kn, g1 * kn)
            v = _read(reader, rule, 2, 0, g0 * kn, g1 * kn)
        else:  # one fused [q | k | v] tensor
            q_size, k_size = h.heads * h.head_dim, h.groups * h.head_dim
            q = _read(reader, rule, 0, 0, g0 * qn, g1 * qn)
            k = _read(reader, rule, 0, 0, q_size + g0 * kn, q_size + g1 * kn)
            v = _read(reader, rule, 0, 0, q_size + k_size + g0 * kn, q_size + k_size + g1 * kn)
        rest = q.shape[1:]
        n = g1 - g0
        fused = torch.cat([q.reshape(n, qn, *rest), k.reshape(n, kn, *rest), v.reshape(n, kn, *rest)], dim=1)
        return fused.reshape(-1, *rest)
    raise ValueError(f"unknown rule kind {kind!r}")


def hf_pieces(rule: Rule, locals_: list[torch.Tensor], vocab_size: int, heads: Heads | None = None
              ) -> dict[str, torch.Tensor]:
    """The HF tensors of ``rule`` from every tp rank's local tensor (in rank order)."""
    kind = rule.kind
    if kind == "full":
        out = {rule.hf[0]: locals_[0]}
    elif kind == "vocab":
        out = {rule.hf[0]: torch.cat(locals_)[:vocab_size]}
    elif kind in ("column", "row"):
        out = {rule.hf[0]: torch.cat(locals_, dim=0 if kind == "column" else 1)}
    elif kind == "gated":
        halves = [t.chunk(2, dim=0) for t in locals_]
        out = {rule.hf[0]: torch.cat([g for g, _ in halves]), rule.hf[1]: torch.cat([u for _, u in halves])}
    elif kind == "qkv":
        h = heads
        qn, kn = h.per_group * h.head_dim, h.head_dim
        qs, ks, vs = [], [], []
        for t in locals_:
            rest = t.shape[1:]
            grouped = t.reshape(-1, qn + 2 * kn, *rest)
            qs.append(grouped[:, :qn].reshape(-1, *rest))
            ks.append(grouped[:, qn:qn + kn].reshape(-1, *rest))
            vs.append(grouped[:, qn + kn:].reshape(-1, *rest))
        q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
        out = dict(zip(rule.hf, (q, k, v))) if len(rule.hf) == 3 else {rule.hf[0]: torch.cat([q, k, v])}
    else:
        raise ValueError(f"unknown rule kind {kind!r}")
    if rule.transposed:
        out = {name: (t.t() if t.dim() == 2 else t) for name, t in out.items()}
    return {name: t.contiguous() for name, t in out.items()}
