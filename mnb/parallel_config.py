"""The layout: how ranks are arranged (:class:`ParallelConfig`), and the rules of its sizes.

``ParallelConfig(tp=2, pp=2).resolve(world_size)`` fills in dp or says what to change;
``coordinates(rank)`` is Megatron's rank order.  Apart from :mod:`mnb.config` (the model and the
training, which check themselves against a layout), and re-exported by it: ``from mnb.config import
ParallelConfig`` keeps working.  Level 1: imports only :mod:`mnb.fields`.

    >>> ParallelConfig(tp=2, pp=2).resolve(6)
    Traceback (most recent call last):
    ...
    ValueError: tp(2) * pp(2) * cp(1) = 4 does not divide world size 6; ...
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Literal

from mnb.fields import check_fields


def as_vpp(vpp: int | None) -> int:
    """``vpp`` as mnb spells it: an int >= 1 (``None``, which users may pass, means 1: no interleaving).

        >>> as_vpp(None), as_vpp(1), as_vpp(2)
        (1, 1, 2)
    """
    if vpp is None:
        return 1
    if isinstance(vpp, bool) or not isinstance(vpp, int) or vpp < 1:
        raise ValueError(f"vpp must be a positive integer (1 = no interleaving), got {vpp!r}")
    return vpp


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How ranks are arranged.  dp is derived: world / (tp * pp * cp).  ``fsdp`` says how the model's
    state is sharded over the dp ranks (Megatron-FSDP), without changing the process groups."""

    tp: int = 1
    """Tensor-parallel size (Megatron: tensor_model_parallel_size)."""
    pp: int = 1
    """Pipeline-parallel size."""
    vpp: int = 1
    """Virtual pipeline stages per rank: 1 = plain 1F1B, more = interleaved 1F1B.  ``None`` is
    accepted and stored as 1; Megatron's own ``None`` for "no interleaving" is made only where mnb
    calls Megatron (:func:`mnb.megatron.layout.megatron_vpp`)."""
    cp: int = 1
    """Context-parallel size: each sequence split over cp ranks (TE attention when installed, else
    mnb's all-gather attention on the local spec, mnb.megatron.context_parallel)."""
    ep: int = 1
    """Expert-parallel size (MoE models); must divide dp * cp (Megatron's expert grid; see resolve())."""
    dp: int | None = None
    """Data-parallel size; None means 'infer from the world size'."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1 to have any effect)."""
    fsdp: Literal["optim", "optim_grads", "optim_grads_params"] | None = None
    """Megatron-FSDP over the dp (x cp) ranks: what is sharded besides what DDP keeps whole --
    ``"optim"`` (optimizer state, ZeRO-1), ``"optim_grads"`` (+ gradients, ZeRO-2),
    ``"optim_grads_params"`` (+ parameters, ZeRO-3; ``%%megatron --fsdp`` alone); ``None``: Megatron
    DDP.  A way of wrapping the model, not a process-group change (Megatron's
    ``data_parallel_sharding_strategy``; :mod:`mnb.megatron.fsdp`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "vpp", as_vpp(self.vpp))
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_fields(self)
        if self.vpp > 1 and self.pp < 2:
            raise ValueError(
                f"vpp({self.vpp}) needs pipeline parallelism: pp is {self.pp}; "
                "set --pp 2 or more, or drop --vpp"
            )
        if self.dp is not None and self.dp < 1:
            raise ValueError(f"dp must be a positive integer or None, got {self.dp!r}")
        if self.fsdp is not None and self.pp > 1:
            raise ValueError(
                f"fsdp={self.fsdp!r} does not combine with pp({self.pp}): Megatron-FSDP lays its device mesh "
                "over every rank as dp*cp x ep x tp (megatron-core 0.16 and 0.19 mcore_fsdp_adapter), so "
                "there is no pipeline dimension; drop --pp or --fsdp"
            )

    @property
    def model_parallel_size(self) -> int:
        """tp * pp * cp: ranks that hold one replica of the model."""
        return self.tp * self.pp * self.cp

    def resolve(self, world_size: int) -> "ParallelConfig":
        """Return a copy with dp filled in, or raise ValueError saying what to change."""
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, got {world_size}")
        mp = self.model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"tp({self.tp}) * pp({self.pp}) * cp({self.cp}) = {mp} does not divide "
                f"world size {world_size}; choose sizes whose product divides {world_size}"
            )
        dp = world_size // mp
        if self.dp is not None and self.dp != dp:
            raise ValueError(
                f"dp({self.dp}) does not match world size {world_size} / "
                f"(tp*pp*cp = {mp}) = {dp}; leave dp out to infer it"
            )
        # Megatron's expert grid: ep divides the data-parallel * context-parallel ranks.
        if (dp * self.cp) % self.ep:
            raise ValueError(
                f"ep({self.ep}) does not divide dp({dp}) * cp({self.cp}) = {dp * self.cp}; "
                f"expert parallelism splits the data-parallel ranks of world size {world_size}"
            )
        return replace(self, dp=dp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index in each group, in Megatron's default order tp-cp-ep-dp-pp.

        Lets the notebook label output under a new layout before the ranks
        report it; a test checks it against what the ranks report.  The expert
        grid splits the tp*cp*dp ranks of a stage as etp(=tp)-ep-edp.
        """
        if self.dp is None:
            raise ValueError("resolve() the layout first: dp is not known")
        tp, cp, dp = self.tp, self.cp, self.dp
        return {
            "tp": rank % tp,
            "pp": rank // (tp * cp * dp),
            "dp": (rank // (tp * cp)) % dp,
            "cp": (rank // tp) % cp,
            "ep": (rank // tp) % self.ep,
        }

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """Short text such as 'tp2 pp2 dp1 sp'."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp{self.vpp}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts.append(f"dp{self.dp if self.dp is not None else '?'}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.fsdp is not None:
            parts.append(f"fsdp:{self.fsdp}")
        return " ".join(parts)


FSDP_STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
"""Values of ``ParallelConfig.fsdp`` (Megatron's ``data_parallel_sharding_strategy`` without ``no_shard``)."""

FSDP_OPTIM_ON_CPU = (
    "--fsdp optim is refused on CPU ranks: there Megatron-FSDP's ZeRO-1 path does not give DDP's gradients "
    "(measured on gloo: grad norm 2x DDP's with megatron-core 0.16.1, losses off by 1e-3 after 3 steps with "
    "0.19.2); use --fsdp optim_grads (it shards the optimizer state too) or a GPU pool"
)
"""Why ``fsdp="optim"`` is refused on CPU ranks (the magic before any rank is touched, and ``mnb.train``)."""


def divisors(n: int) -> list[int]:
    """The sizes that divide ``n`` (what tp may be for ``n`` attention heads), ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]
