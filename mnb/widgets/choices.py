"""The explorer's rules as pure functions: what a setting may be, and what the settings lead to.

Every rule comes from the config classes: each candidate is tried against
:meth:`mnb.config.ParallelConfig.resolve`, :meth:`mnb.config.ModelConfig.check_parallel`
and :meth:`mnb.config.TrainConfig.num_microbatches` (plus Megatron-Core's
interleaving rule, :func:`mnb.config.interleave_problem`), and the message of the first
rule that fails is the reason shown to the user::

    >>> from mnb.config import load_preset, ParallelConfig
    >>> opts = axis_options("tp", load_preset("llama-8b"), ParallelConfig(), gpus=8)
    >>> opts.valid
    [1, 2, 4, 8]
    >>> opts.unavailable[3]
    'tp(3) * pp(1) * cp(1) = 3 does not divide world size 8; choose sizes whose product divides 8'

The explorer widget is a view of :func:`derive`: settings in; the settings moved
to the nearest valid values (with the reasons), the values each layout axis
offers, and the predictions out::

    >>> d = derive(Settings(model="llama-8b", gpus=4, tp=8))
    >>> d.settings.tp, d.adjustments
    (4, ('tp 8 -> 4: tp(8) * pp(1) * cp(1) = 8 does not divide world size 4; choose sizes whose product divides 4',))
    >>> d.predictions.as_dict()["layout"]
    'tp4 pp1 dp1'

A value typed in directly is refused instead (:func:`refusal`), with the same reasons.
Pure Python: no widgets, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import mnb.estimate as est
from mnb.config import ModelConfig, ParallelConfig, TrainConfig, batch_problem, divisors, interleave_problem
from mnb.presets import preset_names
from mnb.model_source import checkpoint_folder, resolve_model
from mnb.estimate import hardware

AXES = ("tp", "pp", "vpp", "cp", "ep")
"""The layout sizes the explorer offers, in Megatron's order."""
SETTLE_ORDER = ("tp", "cp", "ep", "pp", "vpp")
"""The order :func:`settle` tries layout sizes in (pp and vpp last: the batch limits them too)."""
MODEL_DIMS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "seq_length")
"""ModelConfig fields the explorer exposes (Megatron's names)."""
TRAIN_TRAITS = ("micro_batch_size", "global_batch_size", "recompute", "use_distributed_optimizer", "bf16")
"""TrainConfig fields the explorer exposes (and a measured run passes to ``mnb.train``)."""
MAX_LISTED = 8
"""Every value up to this is a candidate; above it only divisors and powers of two."""

_PAR = ParallelConfig()
_TRAIN = TrainConfig()


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the explorer's predictions depend on, as plain values (its ``CONFIG_TRAITS``).

    Defaults come from :class:`ParallelConfig` and :class:`TrainConfig`; ``model`` is a preset
    name or a Hugging Face checkpoint folder (its config.json); a model dimension left at None
    is the model's.  ``num_query_groups`` 0 is one group
    per head (MHA), ``ffn_hidden_size`` 0 is 4 * hidden_size, ``global_batch_size``
    0 is one microbatch per data-parallel rank.
    """

    model: str = "llama-8b"
    num_layers: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    seq_length: int | None = None
    gpu: str = "h200"
    gpus: int = 8
    tp: int = _PAR.tp
    pp: int = _PAR.pp
    vpp: int = _PAR.vpp
    cp: int = _PAR.cp
    ep: int = _PAR.ep
    sequence_parallel: bool = _PAR.sequence_parallel
    fsdp: Literal["optim", "optim_grads", "optim_grads_params"] | None = _PAR.fsdp
    micro_batch_size: int = _TRAIN.micro_batch_size
    global_batch_size: int = _TRAIN.global_batch_size or 0
    recompute: Literal["none", "selective", "full"] = _TRAIN.recompute
    use_distributed_optimizer: bool = _TRAIN.use_distributed_optimizer
    bf16: bool = _TRAIN.bf16

    def dims(self) -> tuple[int | None, ...]:
        return tuple(getattr(self, name) for name in MODEL_DIMS)

    def with_preset_dims(self) -> "Settings":
        """Model dimensions left at None filled from the preset (``0`` where the preset says None)."""
        if None not in self.dims():
            return self
        preset = resolve_model(self.model)
        return replace(self, **{name: (getattr(preset, name) or 0) for name in MODEL_DIMS
                                if getattr(self, name) is None})

    def model_overrides(self) -> dict[str, Any]:
        """The dimensions that differ from the preset, as ``mnb.gpt(model, **overrides)`` takes them."""
        base = resolve_model(self.model)
        values = {name: getattr(self.with_preset_dims(), name) for name in MODEL_DIMS}
        values["num_query_groups"] = values["num_query_groups"] or None
        values["ffn_hidden_size"] = values["ffn_hidden_size"] or None
        return {k: v for k, v in values.items() if getattr(base, k) != v}

    def model_config(self) -> ModelConfig:
        return resolve_model(self.model, **self.model_overrides())

    def layout_sizes(self) -> dict[str, Any]:
        """The ParallelConfig fields (dp left to the world size), unchecked."""
        return {name: getattr(self, name) for name in (*AXES, "sequence_parallel", "fsdp")}

    def parallel_config(self) -> ParallelConfig:
        """The layout (dp left to the world size); ValueError when the sizes contradict each other."""
        return ParallelConfig(**self.layout_sizes())

    def train_config(self) -> TrainConfig:
        values = {name: getattr(self, name) for name in TRAIN_TRAITS}
        values["global_batch_size"] = values["global_batch_size"] or None
        return TrainConfig(**values)

    def train_or_none(self) -> TrainConfig | None:
        try:
            return self.train_config()
        except ValueError:
            return None

    def dp(self) -> int | None:
        try:
            return self.parallel_config().resolve(self.gpus).dp
        except ValueError:
            return None


CONFIG_TRAITS = tuple(f.name for f in fields(Settings))
"""The settings that define an explorer (what get_state() round-trips), in Settings' order."""


@dataclass(frozen=True)
class AxisOptions:
    """Valid values of one axis given the others, and a reason for each refused candidate."""

    axis: str
    valid: list[int]
    unavailable: dict[int, str] = field(default_factory=dict)


def candidates(axis: str, model: ModelConfig, gpus: int) -> list[int]:
    """Values worth offering for ``axis``: small numbers, divisors and powers of two."""
    if axis == "vpp":
        top = min(model.num_layers, MAX_LISTED)
        return list(range(1, top + 1))
    top = gpus if axis != "pp" else min(gpus, model.num_layers)
    if axis == "ep":
        top = min(top, model.num_moe_experts or 1) if model.is_moe else min(top, 2)
    values = set(range(1, min(top, MAX_LISTED) + 1)) | {d for d in divisors(gpus) if d <= top}
    values |= {2**k for k in range(0, 12) if 2**k <= top}
    return sorted(values)


def check_layout(
    model: ModelConfig,
    parallel: ParallelConfig,
    gpus: int,
    train: TrainConfig | None = None,
    *,
    batch: bool = True,
) -> ParallelConfig:
    """Resolve ``parallel`` on ``gpus`` and check it against the model (and ``train``, if given).

    With ``batch=False`` the global batch only counts for the interleaving rule
    (rounded up to whole microbatches), not for its own divisibility: the
    explorer rounds the batch after the layout changes.  Returns the resolved
    layout; raises ValueError with the numbers otherwise.
    """
    resolved = parallel.resolve(gpus)
    model.check_parallel(resolved)
    if resolved.sequence_parallel and resolved.tp == 1:
        raise ValueError("sequence parallel needs tp > 1 (it splits activations over the tp ranks)")
    if train is not None:
        dp = resolved.dp or 1
        if batch:
            m = train.num_microbatches(dp)
        else:
            per = train.micro_batch_size * dp
            m = -(-(train.global_batch_size or per) // per)
        problem = interleave_problem(m, resolved.pp, resolved.vpp, train.micro_batch_size * dp)
        if problem:
            raise ValueError(problem)
    return resolved


def axis_options(
    axis: str, model: ModelConfig, parallel: ParallelConfig | dict[str, Any], gpus: int,
    train: TrainConfig | None = None,
) -> AxisOptions:
    """Try every candidate of ``axis`` with the other sizes of ``parallel`` held fixed.

    ``parallel`` may also be a dict of ParallelConfig fields that contradict each
    other (pp 1 with vpp 2): the candidates that resolve the contradiction are valid.
    """
    if axis not in AXES:
        raise ValueError(f"axis must be one of {', '.join(AXES)}, got {axis!r}")
    valid: list[int] = []
    refused: dict[int, str] = {}
    for value in candidates(axis, model, gpus):
        reason = axis_refusal(axis, value, model, parallel, gpus, train)
        if reason:
            refused[value] = reason
        else:
            valid.append(value)
    return AxisOptions(axis=axis, valid=valid, unavailable=refused)


def axis_refusal(axis: str, value: int, model: ModelConfig, parallel: ParallelConfig | dict[str, Any],
                 gpus: int, train: TrainConfig | None = None) -> str:
    """Why ``axis`` cannot be ``value`` with the other sizes of ``parallel`` ('' when it can).

    The batch (``train``) only limits pp and vpp: the interleaved schedule needs
    as many microbatches as stages.
    """
    sizes = parallel.as_dict() if isinstance(parallel, ParallelConfig) else dict(parallel)
    sizes.update(dp=None, **{axis: value})
    return _layout_refusal(model, sizes, gpus, train if axis in ("vpp", "pp") else None)


def _layout_refusal(model: ModelConfig, sizes: dict[str, Any], gpus: int, train: TrainConfig | None) -> str:
    """Why the layout of ``sizes`` (ParallelConfig fields) cannot run ('' when it can).

    tp 1 turns sequence parallelism off instead of refusing it.
    """
    if sizes["tp"] == 1:
        sizes = {**sizes, "sequence_parallel": False}
    try:
        check_layout(model, ParallelConfig(**sizes), gpus, train, batch=False)
    except ValueError as err:
        return str(err)
    return ""


def nearest(value: int, valid: list[int]) -> int:
    """The valid value closest to ``value`` (the smaller one on a tie)."""
    if not valid:
        raise ValueError("no valid value to choose from")
    return min(valid, key=lambda v: (abs(v - value), v))


def refusal(settings: Settings, name: str, value: Any) -> str:
    """Why setting ``name`` to ``value`` is refused, the other settings held ('' when it is allowed).

    What the explorer's traits check before they take a value; :func:`derive` then
    moves the *other* settings where the new value makes them invalid.
    """
    if name == "model":
        if value in preset_names():
            return ""
        if checkpoint_folder(value) is None:
            return (f"unknown model preset {value!r}; choose from {', '.join(preset_names())}, "
                    "or give a Hugging Face checkpoint folder (with its config.json)")
        try:
            resolve_model(value)
        except ValueError as err:  # an architecture or setting mnb cannot build
            return str(err)
        return ""
    if name == "gpu":
        try:
            hardware.device(value)
        except ValueError as err:
            return str(err)
        return ""
    floor = 0 if name in ("num_query_groups", "ffn_hidden_size", "global_batch_size") else 1
    if isinstance(value, int) and not isinstance(value, bool) and value < floor:
        return f"{name} must be at least {floor}, got {value}"
    trial = replace(settings.with_preset_dims(), **{name: value})
    if name in MODEL_DIMS:
        try:
            trial.model_config()
        except ValueError as err:
            return str(err)
    elif name in AXES:
        try:
            model = trial.model_config()
        except ValueError as err:  # the model itself is refused: the layout is judged once it is fixed
            return f"the model settings are invalid: {err}"
        return axis_refusal(name, value, model, trial.layout_sizes(), trial.gpus, trial.train_or_none())
    elif name == "global_batch_size" and value:
        dp = trial.dp()
        if dp:
            return batch_problem(value, trial.micro_batch_size, dp)
    return ""


@dataclass(frozen=True)
class Predictions:
    """What the estimators say about one valid set of settings."""

    layout: ParallelConfig
    """Resolved (dp filled in)."""
    num_microbatches: int
    global_batch_size: int
    memory: est.MemoryEstimate
    step_time: est.StepTimeEstimate
    bubble: float
    peak_source: str
    """What MFU is measured against."""
    rough: str = ""
    """Why the time predictions are only rough, where they are (CPU ranks); empty elsewhere."""
    dp_traffic: est.DataParallelTraffic | None = None
    """The data-parallel collectives of one step (what the sharding level moves)."""

    def as_dict(self) -> dict[str, Any]:
        """The numbers as plain data (the explorer's ``predicted`` trait)."""
        mem, time = self.memory, self.step_time
        return {
            "layout": self.layout.describe(),
            "dp": self.layout.dp,
            "num_microbatches": self.num_microbatches,
            "global_batch_size": self.global_batch_size,
            "peak_bytes": mem.peak_bytes,
            "peak_stage": mem.peak_stage,
            "stage_bytes": [s.total_bytes for s in mem.stages],
            "components": mem.stages[mem.peak_stage].components(),
            "capacity_bytes": mem.capacity_bytes,
            "fits": mem.fits,
            "bubble": self.bubble,
            "step_time_s": time.total_s,
            "tokens_per_s": time.tokens_per_s,
            "mfu": time.mfu,
            "hfu": time.hfu,
            "explain": [[name, seconds] for name, seconds in time.explain().rows],
            "peak_source": self.peak_source,
            "rough": self.rough,
            "sharding": self.dp_traffic.level if self.dp_traffic else "",
            "dp_collectives_bytes": self.dp_traffic.as_dict() if self.dp_traffic else {},
        }


@dataclass(frozen=True)
class Derived:
    """What :func:`derive` makes of a set of settings."""

    settings: Settings
    """The settings with every size the others no longer allow moved to the nearest allowed value."""
    options: dict[str, AxisOptions]
    """Per layout axis, the values the (adjusted) settings allow and why the others are refused."""
    predictions: Predictions | None
    """None when the settings cannot be estimated (``error`` says why)."""
    adjustments: tuple[str, ...] = ()
    """One line per moved setting: 'tp 8 -> 4: <the reason 8 is refused>'."""
    error: str = ""


def derive(settings: Settings, previous: Settings | None = None, *,
           cpu_peak_flops: float | None = None) -> Derived:
    """Adjusted settings, the options per layout axis, and the predictions.

    ``previous`` is what was shown before: a new model whose dimensions did not
    change with it loads its preset's dimensions.  ``cpu_peak_flops`` is the CPU
    ranks' measured GEMM peak, for MFU on ``gpu="cpu"``.
    """
    if previous is not None and settings.model != previous.model and settings.dims() == previous.dims():
        settings = replace(settings, **{name: None for name in MODEL_DIMS})
    s = settings.with_preset_dims()
    try:
        model = s.model_config()
    except ValueError as err:
        return Derived(settings=s, options={}, predictions=None, error=str(err))
    s, notes = settle(model, s)
    if s.tp == 1 and s.sequence_parallel:
        s = replace(s, sequence_parallel=False)
    dp = s.dp()
    if dp and s.global_batch_size and batch_problem(s.global_batch_size, s.micro_batch_size, dp):
        per = s.micro_batch_size * dp
        new = -(-s.global_batch_size // per) * per
        notes.append(f"global_batch_size {s.global_batch_size} -> {new}: a multiple of "
                     f"micro_batch_size({s.micro_batch_size}) * dp({dp}) = {per}")
        s = replace(s, global_batch_size=new)
    options = {axis: axis_options(axis, model, s.layout_sizes(), s.gpus, s.train_or_none()) for axis in AXES}
    try:
        predictions = predict(model, s, cpu_peak_flops=cpu_peak_flops)
    except ValueError as err:
        return Derived(settings=s, options=options, predictions=None, adjustments=tuple(notes), error=str(err))
    return Derived(settings=s, options=options, predictions=predictions, adjustments=tuple(notes))


def settle(model: ModelConfig, settings: Settings) -> tuple[Settings, list[str]]:
    """Move the layout sizes the other settings rule out to the nearest allowed value, one at a time.

    Each size is judged with all the others as they are, so a size that no value
    makes valid is left for a later one to move (pp 4 on 6 GPUs: pp moves, not tp);
    passes repeat until nothing moves.  If the layout is still refused then (no
    single size could fix it: tp 4 * pp 4 on 6 GPUs), its first refused size goes
    back to 1 and the passes run again; all sizes 1 is always allowed.
    Returns the settings and one line per move: 'tp 8 -> 4: <why 8 is refused>'.
    """
    s, notes = settings, []

    def move(axis: str, new: int, reason: str) -> None:
        nonlocal s
        notes.append(f"{axis} {getattr(s, axis)} -> {new}: {reason}")
        s = replace(s, **{axis: new})

    def refused(axis: str) -> str:
        return axis_refusal(axis, getattr(s, axis), model, s.layout_sizes(), s.gpus, s.train_or_none())

    for _round in range(len(SETTLE_ORDER) + 1):  # each round but the last sets one more size to 1
        for _pass in SETTLE_ORDER:  # while something moves, one pass per size at most
            moved = False
            for axis in SETTLE_ORDER:
                opts = axis_options(axis, model, s.layout_sizes(), s.gpus, s.train_or_none())
                value = getattr(s, axis)
                if value in opts.valid or not opts.valid:
                    continue
                move(axis, nearest(value, opts.valid), opts.unavailable.get(value) or refused(axis))
                moved = True
            if not moved:
                break
        stuck = next((a for a in SETTLE_ORDER if getattr(s, a) != 1 and refused(a)), None)
        if stuck is None:
            break
        move(stuck, 1, refused(stuck))
    return s, notes


CPU_ROUGH = ("rough on CPU ranks: step time, tokens/s and MFU count only the GEMMs at the peak above; "
             "small models on CPU ranks spend most of a step in Python, small kernels and gloo, "
             "so measured steps are often several times longer")
"""The caveat every CPU prediction carries (the estimators model GPUs; BENCHMARKS.md has CPU runs)."""


def predict(model: ModelConfig, settings: Settings, *, cpu_peak_flops: float | None = None) -> Predictions:
    """Memory, bubble, step time and MFU of valid settings; ValueError (with the numbers) otherwise."""
    train = settings.train_config()
    resolved = check_layout(model, settings.parallel_config(), settings.gpus, train)
    on_cpu = settings.gpu == "cpu"
    mem = est.memory(model, resolved, train, gpu=settings.gpu, cpu_kernels=on_cpu, fused_kernels=not on_cpu)
    peak = cpu_peak_flops if on_cpu else None
    time = est.step_time(model, resolved, train, gpu=settings.gpu, peak_flops=peak)
    m = train.num_microbatches(resolved.dp or 1)
    source = (f"measured CPU peak {peak / 1e9:,.0f} GFLOP/s per rank" if peak else
              "nominal CPU peak 1 TFLOP/s (train on a CPU pool once to measure it)" if on_cpu else
              f"{hardware.device(settings.gpu).label} datasheet peak")
    return Predictions(layout=resolved, num_microbatches=m,
                       global_batch_size=m * train.micro_batch_size * (resolved.dp or 1),
                       memory=mem, step_time=time, bubble=est.bubble(resolved, m), peak_source=source,
                       rough=CPU_ROUGH if on_cpu else "", dp_traffic=est.dp_traffic(model, resolved, train))
