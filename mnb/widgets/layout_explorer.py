"""The parallelism explorer: pick a model, GPUs and a layout; see memory, bubble, step time and MFU.

    import mnb
    ex = mnb.explorer(model="llama-8b", gpus=8, gpu="h200")   # display it as a cell's last line
    ex.tp = 2                       # traits drive it from code as the controls do from the page
    ex.predicted["peak_bytes"]      # the numbers behind the plots
    ex.tp = 3                       # TraitError: tp(3) * pp(1) * cp(1) = 3 does not divide world size 8; ...

Every setting is a typed, documented, synced trait whose default comes from
:class:`mnb.config.ParallelConfig` / :class:`mnb.config.TrainConfig` or the
model preset; the rules live in ``@validate`` methods that try the proposal
against the config classes and raise ``TraitError`` with their message.  One
``observe`` handler keeps the dependent sizes valid (a layout that a new GPU
count or head count no longer allows moves to the nearest valid value),
refreshes the offered values with the reasons for the others, and redraws.

Outputs are widget traits too (``predicted``, ``measured``, ``options``,
``unavailable``, the PNG bytes of the plots), so the page can be reloaded:
the state lives in the kernel and the views are rebuilt from it.

"Run on pool" (or :meth:`Explorer.run_on_pool`) trains a few steps with the
current layout on the running pool, re-laid-out in place, in a background
thread: the kernel stays free, and the plots gain the measured memory,
timeline and MFU (tokens/s on CPU) when the ranks are done.  Widget updates
from that thread are comm messages, which ipykernel sends from any thread.
The pool runs one request at a time: wait for the run (the button says
"Running...") before sending other cells to the ranks.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace
from typing import Any, Iterator

import ipywidgets as widgets
from traitlets import Bool, Bytes, Dict, Enum, Int, TraitError, Unicode, observe, validate

import mnb.estimate as est
from mnb.config import ModelConfig, ParallelConfig, TrainConfig, load_preset, model_config, preset_names
from mnb.controller.registry import measured_cpu_peak_flops
from mnb.estimate import hardware

from . import _explorer_view as view
from .choices import AXES, axis_options, check_layout, nearest
from .explorer_pool import PoolRunMixin

_PAR = ParallelConfig()
_TRAIN = TrainConfig()
_MODEL = ModelConfig()

MODEL_DIMS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
              "seq_length")
"""ModelConfig fields the explorer exposes (Megatron's names)."""
TRAIN_TRAITS = ("micro_batch_size", "global_batch_size", "recompute", "use_distributed_optimizer", "bf16")
CONFIG_TRAITS = ("model", *MODEL_DIMS, "gpu", "gpus", *AXES, "sequence_parallel", *TRAIN_TRAITS)
"""The traits that define a configuration (what get_state() round-trips)."""


class Explorer(PoolRunMixin, widgets.VBox):
    """Parallel layouts of a model on N GPUs: predicted (and measured) memory, bubble, step time, MFU."""

    # ----- model ------------------------------------------------------------------
    model = Unicode("llama-8b", help="Model preset the dimensions start from (templates/presets/).").tag(sync=True)
    num_layers = Int(_MODEL.num_layers, help="Transformer layers.").tag(sync=True)
    hidden_size = Int(_MODEL.hidden_size, help="Hidden size h.").tag(sync=True)
    num_attention_heads = Int(_MODEL.num_attention_heads, help="Attention heads a.").tag(sync=True)
    num_query_groups = Int(0, help="Grouped-query attention groups; 0 = one per head (MHA).").tag(sync=True)
    ffn_hidden_size = Int(0, help="MLP width; 0 = 4 * hidden_size.").tag(sync=True)
    seq_length = Int(_MODEL.seq_length, help="Training sequence length s.").tag(sync=True)
    # ----- hardware ---------------------------------------------------------------
    gpu = Unicode("h200", help="Hardware-table entry (mnb.estimate.DEVICES): peak FLOP/s and capacity.").tag(sync=True)
    gpus = Int(8, help="Number of GPUs (the world size).").tag(sync=True)
    # ----- layout -----------------------------------------------------------------
    tp = Int(_PAR.tp, help="Tensor-parallel size.").tag(sync=True)
    pp = Int(_PAR.pp, help="Pipeline-parallel size.").tag(sync=True)
    vpp = Int(_PAR.vpp, help="Virtual stages per pipeline rank (1 = plain 1F1B).").tag(sync=True)
    cp = Int(_PAR.cp, help="Context-parallel size.").tag(sync=True)
    ep = Int(_PAR.ep, help="Expert-parallel size (MoE models).").tag(sync=True)
    sequence_parallel = Bool(_PAR.sequence_parallel, help="Megatron sequence parallelism (tp > 1).").tag(sync=True)
    # ----- batch and memory savers -------------------------------------------------
    micro_batch_size = Int(_TRAIN.micro_batch_size, help="Micro batch size b.").tag(sync=True)
    global_batch_size = Int(_TRAIN.global_batch_size or 0,
                            help="Global batch; 0 = micro_batch_size * dp (one microbatch).").tag(sync=True)
    recompute = Enum(("none", "selective", "full"), _TRAIN.recompute, help="Activation recomputation.").tag(sync=True)
    use_distributed_optimizer = Bool(_TRAIN.use_distributed_optimizer,
                                     help="Shard optimizer state over dp (ZeRO-1).").tag(sync=True)
    bf16 = Bool(_TRAIN.bf16, help="bf16 mixed precision (else fp32).").tag(sync=True)
    run_steps = Int(5, help="Steps of the measured run on the pool.").tag(sync=True)
    # ----- outputs ----------------------------------------------------------------
    options = Dict(help="Valid values per layout axis, given the other settings.").tag(sync=True)
    unavailable = Dict(help="Per axis: {value: reason it is refused}.").tag(sync=True)
    predicted = Dict(help="Predicted numbers: peak_bytes, stage_bytes, components, bubble, step_time_s, mfu, ...").tag(sync=True)
    measured = Dict(help="Measured numbers of the last run on the pool (empty until one ran).").tag(sync=True)
    error = Unicode("", help="Why the current settings cannot be estimated (empty when they can).").tag(sync=True)
    status = Unicode("", help="What the last action did (rounding, refusals, pool runs).").tag(sync=True)
    running = Bool(False, help="A measured run is in progress on the pool.").tag(sync=True)
    memory_png = Bytes(b"", help="The memory figure (PNG; shown by an Image child, which syncs it).")
    timeline_png = Bytes(b"", help="The pipeline timeline figure (PNG; shown by an Image child).")

    def __init__(self, model: str = "llama-8b", gpus: int = 8, gpu: str = "h200", **settings: Any) -> None:
        unknown = sorted(set(settings) - set(CONFIG_TRAITS) - {"run_steps"})
        if unknown:
            raise TypeError(f"unknown explorer setting(s) {unknown}; choose from {', '.join(CONFIG_TRAITS)}")
        self._hold = 0
        self._busy = False
        self._dirty = False
        self._run = None  # the measured mnb.runs.Run shown beside the predictions
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()  # the background run redraws while the page may change settings
        super().__init__()
        self.add_class("mnb-explorer")
        with self._batched():
            self.gpu, self.gpus = gpu, gpus
            self.model = model
            self._load_preset(model)
            for name, value in settings.items():
                setattr(self, name, value)
        self.controls = view.build(self)
        self.children = view.layout(self)
        self._refresh()

    # ----- configuration objects -----------------------------------------------------
    def model_config(self) -> ModelConfig:
        """The ModelConfig of the current settings (preset + the dimensions shown)."""
        return model_config(self.model, **self._model_overrides())

    def _model_overrides(self, **proposed: Any) -> dict[str, Any]:
        values = {name: getattr(self, name) for name in MODEL_DIMS}
        values.update(proposed)
        values["num_query_groups"] = values["num_query_groups"] or None
        values["ffn_hidden_size"] = values["ffn_hidden_size"] or None
        base = load_preset(proposed.get("model", self.model))
        return {k: v for k, v in values.items() if getattr(base, k) != v}

    def parallel_config(self, **proposed: Any) -> ParallelConfig:
        """The layout of the current settings (dp left to the world size)."""
        values = {a: getattr(self, a) for a in AXES}
        values["sequence_parallel"] = self.sequence_parallel
        values.update(proposed)
        return ParallelConfig(**values)

    def train_config(self, **proposed: Any) -> TrainConfig:
        values = {name: getattr(self, name) for name in TRAIN_TRAITS}
        values.update(proposed)
        values["global_batch_size"] = values["global_batch_size"] or None
        return TrainConfig(**values)

    def _train_args(self) -> dict[str, Any]:
        """The TrainConfig fields a measured run passes to ``mnb.train``."""
        train = self.train_config()
        return {k: getattr(train, k) for k in TRAIN_TRAITS}

    def config(self) -> dict[str, Any]:
        """The settings as plain data: ``Explorer(**ex.config())`` rebuilds the same explorer."""
        return {name: getattr(self, name) for name in CONFIG_TRAITS}

    # ----- rules -----------------------------------------------------------------------
    @validate("model")
    def _check_model(self, proposal):
        if proposal["value"] not in preset_names():
            raise TraitError(f"unknown model preset {proposal['value']!r}; choose from {', '.join(preset_names())}")
        return proposal["value"]

    @validate(*MODEL_DIMS)
    def _check_dims(self, proposal):
        name, value = proposal["trait"].name, proposal["value"]
        floor = 0 if name in ("num_query_groups", "ffn_hidden_size") else 1
        if value < floor:
            raise TraitError(f"{name} must be at least {floor}, got {value}")
        try:
            model_config(self.model, **self._model_overrides(**{name: value}))
        except ValueError as err:
            raise TraitError(str(err)) from None
        return value

    @validate("gpu")
    def _check_gpu(self, proposal):
        try:
            hardware.device(proposal["value"])
        except ValueError as err:
            raise TraitError(str(err)) from None
        return proposal["value"]

    @validate("gpus")
    def _check_gpus(self, proposal):
        if proposal["value"] < 1:
            raise TraitError(f"gpus must be at least 1, got {proposal['value']}")
        return proposal["value"]

    @validate(*AXES)
    def _check_axis(self, proposal):
        """A layout size is refused, with the config's reason, unless the model and world allow it."""
        name, value = proposal["trait"].name, proposal["value"]
        if not isinstance(value, int) or value < 1:
            raise TraitError(f"{name} must be a positive integer, got {value!r}")
        try:
            trial = self.parallel_config(**{name: value})
            if name == "tp" and value == 1:
                trial = replace(trial, sequence_parallel=False)
            check_layout(self.model_config(), trial, self.gpus,
                         self._train_or_none() if name in ("pp", "vpp") else None, batch=False)
        except ValueError as err:
            raise TraitError(str(err)) from None
        return value

    def _train_or_none(self) -> TrainConfig | None:
        try:
            return self.train_config()
        except ValueError:
            return None

    @validate("micro_batch_size", "global_batch_size", "run_steps")
    def _check_batch(self, proposal):
        name, value = proposal["trait"].name, proposal["value"]
        floor = 0 if name == "global_batch_size" else 1
        if value < floor:
            raise TraitError(f"{name} must be at least {floor}, got {value}")
        if name == "global_batch_size" and value:
            dp = self._dp()
            if dp and value % (self.micro_batch_size * dp):
                raise TraitError(
                    f"global_batch_size({value}) is not divisible by micro_batch_size"
                    f"({self.micro_batch_size}) * dp({dp}) = {self.micro_batch_size * dp}"
                )
        return value

    def _dp(self) -> int | None:
        try:
            return self.parallel_config().resolve(self.gpus).dp
        except ValueError:
            return None

    # ----- behaviour ---------------------------------------------------------------------
    @observe(*CONFIG_TRAITS)
    def _on_setting(self, change) -> None:
        if change["name"] == "model" and not self._hold:
            with self._batched():
                self._load_preset(change["new"])
        if self.measured:
            self.measured = {}
            self._run = None
        self._refresh()

    @observe("status", "running")
    def _on_status(self, change) -> None:
        view.sync_status(self)

    def _load_preset(self, name: str) -> None:
        preset = load_preset(name)
        for dim in MODEL_DIMS:
            value = getattr(preset, dim)
            setattr(self, dim, 0 if value is None else value)

    @contextlib.contextmanager
    def _batched(self) -> Iterator[None]:
        """Apply several settings at once: rules checked together, one refresh at the end."""
        self._hold += 1
        try:
            with self.hold_trait_notifications():
                yield
        finally:
            self._hold -= 1
        if not self._hold and hasattr(self, "controls"):
            self._refresh()

    def set_state(self, sync_data):
        """Front-end updates (and get_state() round trips) apply as one batch."""
        with self._batched():
            super().set_state(sync_data)

    def _refresh(self) -> None:
        if self._hold or not hasattr(self, "controls"):
            self._dirty = True
            return
        if self._busy:
            self._dirty = True
            return
        self._busy = True
        self._lock.acquire()
        try:
            self._dirty = True
            rounds = 0
            while self._dirty and rounds < 10:
                self._dirty = False
                rounds += 1
                self._keep_valid()
            self._estimate()
            view.sync_controls(self)
        finally:
            self._lock.release()
            self._busy = False

    def _keep_valid(self) -> None:
        """Move sizes the other settings no longer allow to the nearest allowed value."""
        try:
            model = self.model_config()
        except ValueError as err:
            self.error = str(err)
            return
        notes = []
        options: dict[str, list[int]] = {}
        refused: dict[str, dict[str, str]] = {}
        train = self._train_or_none()
        for axis in ("tp", "cp", "ep", "pp", "vpp"):
            opts = axis_options(axis, model, self.parallel_config(), self.gpus, train)
            valid = opts.valid or [1]
            if getattr(self, axis) not in valid:
                new = nearest(getattr(self, axis), valid)
                notes.append(f"{axis} {getattr(self, axis)} -> {new}: {opts.unavailable.get(getattr(self, axis), '')}")
                setattr(self, axis, new)
            options[axis] = valid
            refused[axis] = {str(k): v for k, v in opts.unavailable.items()}
        if self.tp == 1 and self.sequence_parallel:
            self.sequence_parallel = False
        dp = self._dp()
        if dp and self.global_batch_size and self.global_batch_size % (self.micro_batch_size * dp):
            per = self.micro_batch_size * dp
            new = -(-self.global_batch_size // per) * per
            notes.append(f"global_batch_size {self.global_batch_size} -> {new}: a multiple of "
                         f"micro_batch_size({self.micro_batch_size}) * dp({dp}) = {per}")
            self.global_batch_size = new
        self.options, self.unavailable = options, refused
        if notes:
            self.status = "adjusted " + "; ".join(notes)

    def _estimate(self) -> None:
        """Predictions for the current settings, and the figures."""
        try:
            model, parallel, train = self.model_config(), self.parallel_config(), self.train_config()
            resolved = check_layout(model, parallel, self.gpus, train)
            on_cpu = self.gpu == "cpu"
            mem = est.memory(model, resolved, train, gpu=self.gpu, cpu_kernels=on_cpu, fused_kernels=not on_cpu)
            cpu_peak = measured_cpu_peak_flops() if on_cpu else None
            time = est.step_time(model, resolved, train, gpu=self.gpu, peak_flops=cpu_peak)
            m = train.num_microbatches(resolved.dp or 1)
        except ValueError as err:
            self.error = str(err)
            self.predicted = {}
            self.memory_png = self.timeline_png = view.message(str(err))
            return
        self.error = ""
        peak = mem.stages[mem.peak_stage]
        self.predicted = {
            "layout": resolved.describe(),
            "dp": resolved.dp,
            "num_microbatches": m,
            "global_batch_size": m * train.micro_batch_size * (resolved.dp or 1),
            "peak_bytes": mem.peak_bytes,
            "peak_stage": mem.peak_stage,
            "stage_bytes": [s.total_bytes for s in mem.stages],
            "components": peak.components(),
            "capacity_bytes": mem.capacity_bytes,
            "fits": mem.fits,
            "bubble": est.bubble(resolved, m),
            "step_time_s": time.total_s,
            "tokens_per_s": time.tokens_per_s,
            "mfu": time.mfu,
            "peak_source": (f"measured CPU peak {cpu_peak / 1e9:,.0f} GFLOP/s per rank" if cpu_peak else
                            "nominal CPU peak 1 TFLOP/s (train on a CPU pool once to measure it)" if on_cpu else
                            f"{hardware.device(self.gpu).label} datasheet peak"),
        }
        self.memory_png = view.memory_png(mem, self._run)
        self.timeline_png = view.timeline_png(resolved, m, self._run)

    # ----- text ---------------------------------------------------------------------------
    def summary(self) -> str:
        """The predictions (and measurements) as text: what a front-end without widgets shows."""
        return view.summary_text(self)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/plain"] = self.summary()
        return bundle


def explorer(model: str = "llama-8b", gpus: int = 8, gpu: str = "h200", **settings: Any) -> Explorer:
    """The parallelism explorer widget; see :class:`Explorer` for the settings.

        ex = mnb.explorer(model="llama-8b", gpus=8, gpu="h200", global_batch_size=128, bf16=True)
        ex          # last line of a cell: the controls and the live predictions
    """
    return Explorer(model=model, gpus=gpus, gpu=gpu, **settings)
