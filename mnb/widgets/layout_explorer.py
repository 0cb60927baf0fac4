"""The parallelism explorer: pick a model, GPUs and a layout; see memory, bubble, step time and MFU.

    import mnb
    ex = mnb.explorer(model="llama-8b", gpus=8, gpu="h200")   # display it as a cell's last line
    ex.tp = 2                       # traits drive it from code as the controls do from the page
    ex.predicted["peak_bytes"]      # the numbers behind the plots
    ex.tp = 3                       # TraitError: tp(3) * pp(1) * cp(1) = 3 does not divide world size 8; ...

Every setting is a typed, documented, synced trait whose default comes from
:class:`mnb.config.ParallelConfig` / :class:`mnb.config.TrainConfig` or the
model preset.  The explorer is a view of two pure functions in
:mod:`mnb.widgets.choices`: one ``@validate`` method refuses a typed value with
:func:`~mnb.widgets.choices.refusal`'s reason (``TraitError``), and one
``observe`` handler shows :func:`~mnb.widgets.choices.derive`'s answer for the
settings: the sizes a new GPU count or head count no longer allows moved to
the nearest valid value (``status`` says which and why), the values each
layout axis offers with the reasons for the others, and the predictions.

Outputs are widget traits too (``predicted``, ``measured``, ``options``,
``unavailable``, the PNG bytes of the plots), so the page can be reloaded:
the state lives in the kernel and the views are rebuilt from it.

"Run on pool" (or :meth:`Explorer.run_on_pool`) trains a few steps with the
current layout on the running pool, re-laid-out in place, in a background
thread (a :class:`~mnb.widgets.explorer_pool.PoolRunner` that calls the explorer
back when the ranks are done): the kernel stays free, and the plots gain the
measured memory, timeline and MFU (tokens/s on CPU), unless the settings
changed meanwhile.  Widget updates from that thread are comm messages, which
ipykernel sends from any thread.  The pool runs one request at a time: wait
for the run (the button says "Running...") before sending other cells to the ranks.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ipywidgets as widgets
from traitlets import Bool, Bytes, Dict, Enum, Int, TraitError, Unicode, observe, validate

from mnb.config import FSDP_STRATEGIES, ModelConfig, ParallelConfig, TrainConfig
from mnb.controller.registry import measured_cpu_peak_flops
from mnb.units import Text

from . import _explorer_view as view
from .choices import CONFIG_TRAITS, MODEL_DIMS, TRAIN_TRAITS, Derived, Settings, derive, refusal
from .explorer_pool import PoolRunner, RunOutcome, RunRequest, no_pool_problem

__all__ = ["CONFIG_TRAITS", "MODEL_DIMS", "TRAIN_TRAITS", "Explorer", "explorer"]

_DEFAULT = Settings()
_MODEL = ModelConfig()


class Explorer(widgets.VBox):
    """Parallel layouts of a model on N GPUs: predicted (and measured) memory, bubble, step time, MFU."""

    # ----- model ------------------------------------------------------------------
    model = Unicode(_DEFAULT.model, help="Model preset (templates/presets/) or Hugging Face checkpoint folder "
                    "(its config.json) the dimensions start from.").tag(sync=True)
    num_layers = Int(_MODEL.num_layers, help="Transformer layers.").tag(sync=True)
    hidden_size = Int(_MODEL.hidden_size, help="Hidden size h.").tag(sync=True)
    num_attention_heads = Int(_MODEL.num_attention_heads, help="Attention heads a.").tag(sync=True)
    num_query_groups = Int(0, help="Grouped-query attention groups; 0 = one per head (MHA).").tag(sync=True)
    ffn_hidden_size = Int(0, help="MLP width; 0 = 4 * hidden_size.").tag(sync=True)
    seq_length = Int(_MODEL.seq_length, help="Training sequence length s.").tag(sync=True)
    # ----- hardware ---------------------------------------------------------------
    gpu = Unicode(_DEFAULT.gpu, help="Hardware-table entry (mnb.estimate.DEVICES): peak FLOP/s and capacity.").tag(sync=True)
    gpus = Int(_DEFAULT.gpus, help="Number of GPUs (the world size).").tag(sync=True)
    # ----- layout -----------------------------------------------------------------
    tp = Int(_DEFAULT.tp, help="Tensor-parallel size.").tag(sync=True)
    pp = Int(_DEFAULT.pp, help="Pipeline-parallel size.").tag(sync=True)
    vpp = Int(_DEFAULT.vpp, help="Virtual stages per pipeline rank (1 = plain 1F1B).").tag(sync=True)
    cp = Int(_DEFAULT.cp, help="Context-parallel size.").tag(sync=True)
    ep = Int(_DEFAULT.ep, help="Expert-parallel size (MoE models).").tag(sync=True)
    sequence_parallel = Bool(_DEFAULT.sequence_parallel, help="Megatron sequence parallelism (tp > 1).").tag(sync=True)
    fsdp = Enum(FSDP_STRATEGIES, _DEFAULT.fsdp, allow_none=True,
                help="Megatron-FSDP sharding over dp: None (DDP), optim (ZeRO-1), optim_grads (ZeRO-2), "
                     "optim_grads_params (ZeRO-3).").tag(sync=True)
    # ----- batch and memory savers -------------------------------------------------
    micro_batch_size = Int(_DEFAULT.micro_batch_size, help="Micro batch size b.").tag(sync=True)
    global_batch_size = Int(_DEFAULT.global_batch_size,
                            help="Global batch; 0 = micro_batch_size * dp (one microbatch).").tag(sync=True)
    recompute = Enum(("none", "selective", "full"), _DEFAULT.recompute, help="Activation recomputation.").tag(sync=True)
    use_distributed_optimizer = Bool(_DEFAULT.use_distributed_optimizer,
                                     help="Shard optimizer state over dp (ZeRO-1).").tag(sync=True)
    bf16 = Bool(_DEFAULT.bf16, help="bf16 mixed precision (else fp32).").tag(sync=True)
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
        run_steps = settings.pop("run_steps", None)
        self._derived: Derived | None = None  # what the traits show: derive()'s answer for them
        self._run = None  # the measured mnb.analysis.runs.Run shown beside the predictions
        self._redraw = threading.RLock()  # the background run redraws while the page may change settings
        self._view: view.ExplorerView | None = None
        self._runner = PoolRunner(on_done=self._run_finished, on_progress=self._run_progress)
        super().__init__()
        self.add_class("mnb-explorer")
        model = os.fspath(model)  # a pathlib.Path to a checkpoint folder
        unknown_model = refusal(_DEFAULT, "model", model)  # before its preset's dimensions are read
        if unknown_model:
            raise TraitError(unknown_model)
        initial = Settings(model=model, gpus=gpus, gpu=gpu, **settings).with_preset_dims()
        with self.hold_trait_notifications():  # checked together: each rule sees the final values
            for name in CONFIG_TRAITS:
                setattr(self, name, getattr(initial, name))
            if run_steps is not None:
                self.run_steps = run_steps
        self._update()  # when no setting differed from the traits' defaults, nothing has called it yet
        self._view = view.ExplorerView(self._shown(), on_change=self._from_control,
                                       on_run=lambda: self.run_on_pool())
        self.controls = self._view.controls
        self.children = self._view.children()
        self._view.sync(self._shown())
        self._view.sync_status(self.status, self.running)

    # ----- configuration objects -----------------------------------------------------
    def settings(self, **proposed: Any) -> Settings:
        """The current settings (``proposed`` values in place of the traits')."""
        values = {name: getattr(self, name) for name in CONFIG_TRAITS}
        values.update(proposed)
        return Settings(**values)

    def model_config(self) -> ModelConfig:
        """The ModelConfig of the current settings (preset + the dimensions shown)."""
        return self.settings().model_config()

    def _model_overrides(self) -> dict[str, Any]:
        return self.settings().model_overrides()

    def parallel_config(self, **proposed: Any) -> ParallelConfig:
        """The layout of the current settings (dp left to the world size)."""
        return self.settings(**proposed).parallel_config()

    def train_config(self, **proposed: Any) -> TrainConfig:
        return self.settings(**proposed).train_config()

    def _train_args(self) -> dict[str, Any]:
        """The TrainConfig fields a measured run passes to ``mnb.train``."""
        train = self.train_config()
        return {k: getattr(train, k) for k in TRAIN_TRAITS}

    def config(self) -> dict[str, Any]:
        """The settings as plain data: ``Explorer(**ex.config())`` rebuilds the same explorer."""
        return {name: getattr(self, name) for name in CONFIG_TRAITS}

    # ----- rules (mnb.widgets.choices.refusal: the config classes' own checks) ----------
    @validate(*CONFIG_TRAITS)
    def _check_setting(self, proposal):
        name, value = proposal["trait"].name, proposal["value"]
        reason = refusal(self.settings(), name, value)
        if reason:
            raise TraitError(reason)
        return value

    @validate("run_steps")
    def _check_run_steps(self, proposal):
        if proposal["value"] < 1:
            raise TraitError(f"run_steps must be at least 1, got {proposal['value']}")
        return proposal["value"]

    # ----- behaviour: one observer applies derive() ----------------------------------
    @observe(*CONFIG_TRAITS)
    def _on_setting(self, change) -> None:
        self._update()

    @observe("status", "running")
    def _on_status(self, change) -> None:
        if self._view is not None:
            self._view.sync_status(self.status, self.running)

    @observe("run_steps")
    def _on_run_steps(self, change) -> None:
        self._sync_view()

    def _from_control(self, name: str, value: Any) -> None:
        """The view's callback: a control changed ``name``; a refused value is put back with its reason."""
        if value == getattr(self, name):
            return
        try:
            setattr(self, name, value)
        except TraitError as err:
            self.status = f"refused {name}={value!r}: {err}"
            self._sync_view()

    def _shown(self) -> view.Shown:
        return view.Shown(derived=self._derived, run_steps=self.run_steps, measured=dict(self.measured),
                          memory_png=self.memory_png, timeline_png=self.timeline_png)

    def _sync_view(self) -> None:
        if self._view is not None and self._derived is not None:
            self._view.sync(self._shown())

    def _update(self) -> None:
        """Show derive()'s answer for the current settings (nothing to do when it already shows)."""
        current = self.settings()
        shown = self._derived
        if shown is not None and current == shown.settings:
            return  # our own adjustments arriving, or a batch's later notifications
        derived = derive(current, shown.settings if shown is not None else None,
                         cpu_peak_flops=measured_cpu_peak_flops() if current.gpu == "cpu" else None)
        with self._redraw:
            self._derived = derived  # first: the notifications of the writes below find it shown
            self._run = None
            with self.hold_trait_notifications():
                for name in CONFIG_TRAITS:
                    setattr(self, name, getattr(derived.settings, name))
                self.options = {a: o.valid or [getattr(derived.settings, a)] for a, o in derived.options.items()}
                self.unavailable = {a: {str(k): v for k, v in o.unavailable.items()}
                                    for a, o in derived.options.items()}
                self.measured = {}
                self.error = derived.error
                self.predicted = derived.predictions.as_dict() if derived.predictions is not None else {}
                if derived.adjustments:
                    self.status = "adjusted " + "; ".join(derived.adjustments)
            self._draw()

    def _draw(self) -> None:
        """The figures of the shown predictions (and measured run), and the controls."""
        pred = self._derived.predictions if self._derived is not None else None
        if pred is None:
            self.memory_png = self.timeline_png = view.message(self.error)
        else:
            self.memory_png = view.memory_png(pred.memory, self._run)
            self.timeline_png = view.timeline_png(pred.layout, pred.num_microbatches, self._run)
        self._sync_view()

    # ----- "Run on pool" (a PoolRunner composed in; it reports through _run_finished) ---
    def pool_problem(self, pool: Any = None) -> str:
        """Why "Run on pool" cannot run now ('' when it can)."""
        from mnb.controller import current_pool

        pool = pool if pool is not None else current_pool(required=False)
        problem = no_pool_problem(pool)
        if problem:
            return problem
        if self.running:
            return "a measured run is already in progress"
        if self.gpus != pool.world_size:
            return (f"the explorer plans {self.gpus} GPUs but the pool has {pool.world_size} ranks; "
                    f"set gpus to {pool.world_size} to run this layout")
        if self.error:
            return f"this layout cannot run: {self.error}"
        return ""

    def run_on_pool(self, pool: Any = None, *, wait: bool = False, timeout: float = 600.0) -> threading.Thread | None:
        """Train ``run_steps`` steps of this layout on the pool in a background thread.

        Returns the thread (``wait=True`` joins it).  The kernel stays free; the
        measured memory, timeline and MFU/tokens/s appear when the ranks finish.
        Returns None, with the reason in ``status``, when the pool cannot run it.
        """
        from mnb.controller import current_pool

        pool = pool if pool is not None else current_pool(required=False)
        problem = self.pool_problem(pool)
        if problem:
            self.status = problem
            return None
        settings = self.settings()
        request = RunRequest(model=self.model, parallel=self.parallel_config(), train=self._train_args(),
                             steps=self.run_steps, model_overrides=self._model_overrides(), gpu=self.gpu,
                             tag=settings)
        self.running = True
        self.status = (f"running {self.run_steps} steps of {request.parallel.resolve(pool.world_size).describe()} "
                       "on the pool...")
        try:
            thread = self._runner.start(pool, request, timeout=timeout)
        except RuntimeError as err:  # the pool stopped, or the last run's thread is still ending
            self.running = False
            self.status = str(err)
            return None
        if wait:
            thread.join()
        return thread

    def wait(self, timeout: float | None = None) -> None:
        """Block until the background run (if any) has finished."""
        self._runner.wait(timeout)

    def _run_progress(self, progress) -> None:
        self.status = f"running on the pool: {progress.short()}"

    def _run_finished(self, outcome: RunOutcome) -> None:
        """The runner's callback (its thread): show the measurement beside the predictions it was made for."""
        if outcome.failure is not None:
            status, reason = outcome.failure
            self.running = False
            self.status = f"run failed ({status}): {reason}"
            return
        metrics = outcome.metrics
        done = f"measured {metrics['steps']} steps of {metrics['layout']} on the pool"
        with self._redraw:
            shown = self._derived is not None and self._derived.settings == outcome.request.tag
            if shown:
                self._run = outcome.run
                self.measured = metrics
                self._repredict_with_measured_peak()
                self._draw()
            self.running = False
        self.status = done if shown else f"{done}; not shown: the settings changed while it ran"

    def _repredict_with_measured_peak(self) -> None:
        """On CPU ranks, the run just measured the ranks' GEMM peak: the predictions beside it use it."""
        peak = measured_cpu_peak_flops() if self.gpu == "cpu" else None
        shown = self._derived
        if peak is None or shown is None or shown.predictions is None:
            return
        derived = derive(shown.settings, shown.settings, cpu_peak_flops=peak)
        if derived.settings == shown.settings and derived.predictions is not None:
            self._derived = derived
            self.predicted = derived.predictions.as_dict()

    # ----- text ---------------------------------------------------------------------------
    def summary(self) -> Text:
        """The predictions (and measurements) as text: what a front-end without widgets shows."""
        return Text(view.summary_text(self.model, self.gpus, self.gpu, self.predicted, self.measured, self.error))

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/plain"] = self.summary()
        return bundle


def explorer(model: str = "llama-8b", gpus: int = 8, gpu: str = "h200", **settings: Any) -> Explorer:
    """The parallelism explorer widget; see :class:`Explorer` for the settings.

        ex = mnb.explorer(model="llama-8b", gpus=8, gpu="h200", global_batch_size=128, bf16=True)
        ex          # last line of a cell: the controls and the live predictions
        mnb.explorer(model="/models/Llama-3.2-1B", gpus=8)   # a Hugging Face checkpoint's config.json
    """
    return Explorer(model=model, gpus=gpus, gpu=gpu, **settings)
