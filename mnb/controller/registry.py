"""What the notebook side remembers between cells: the current pool, the last run, profile and settings.

Behind ``mnb.pool()``, ``mnb.last_run`` and ``mnb.last_profile``; plain module state of the notebook kernel
(no process groups, no torch).
"""

from __future__ import annotations

from typing import Any

from mnb.errors import PoolError

# The registry sits below the pool: it holds the pool as an opaque object (never imports
# mnb.controller.pool), and Pool hands it each training's records through record_training().
_CURRENT: list[Any] = []
_LAST_RUN: list[Any] = []
_LAST_PROFILE: list[Any] = []
_CPU_PEAK: dict[str, float] = {}
_SETTINGS: dict[str, Any] = {}


def current_pool(required: bool = True) -> Any:
    """The running :class:`mnb.controller.pool.Pool`, or None (``required=False``)."""
    if _CURRENT:
        return _CURRENT[-1]
    if required:
        raise PoolError("no pool is running; start one with %mnb start (or mnb.controller.Pool.start())")
    return None


def set_current_pool(pool: Any) -> None:
    _CURRENT.clear()
    if pool is not None:
        _CURRENT.append(pool)


def record_training(records: list[dict[str, Any]]) -> None:
    """Take the ranks' records of a cell's last training (one per rank): they become ``mnb.last_run``,
    the model and training settings ``%mnb export`` remembers (:func:`remember_settings`) and, from CPU
    ranks, the measured GEMM peak (:func:`measured_cpu_peak_flops`)."""
    from mnb.analysis.runs import Run

    _LAST_RUN.clear()
    _LAST_RUN.append(Run(records))
    if records:
        remember_settings(model=records[0].get("model"), train=records[0].get("train"),
                          tokenizer=records[0].get("tokenizer"), data_prefix=records[0].get("data_prefix"))
    peaks = [r["peak_flops"] for r in records if r.get("peak_flops") and str(r.get("device", "")).startswith("cpu")]
    if peaks:
        _CPU_PEAK["flops"] = min(peaks)


def measured_cpu_peak_flops() -> float | None:
    """The CPU ranks' measured GEMM peak from the last CPU training (per rank), if any."""
    return _CPU_PEAK.get("flops")


def last_run() -> Any:
    return _LAST_RUN[-1] if _LAST_RUN else None


def set_last_profile(profile: Any) -> None:
    """Keep ``profile`` (a :class:`mnb.notebook.profiles.Profile`, or None) as ``mnb.last_profile``."""
    _LAST_PROFILE.clear()
    if profile is not None:
        _LAST_PROFILE.append(profile)


def last_profile() -> Any:
    """The last cell's merged profile (``mnb.last_profile``), or None."""
    return _LAST_PROFILE[-1] if _LAST_PROFILE else None


def remember_settings(*, model: dict[str, Any] | None = None, train: dict[str, Any] | None = None,
                      tokenizer: str | None = None, data_prefix: str | None = None) -> None:
    """Keep the last model (ModelConfig fields) and training (TrainConfig fields) the notebook used.

    ``tokenizer`` belongs to ``model``: the Hugging Face folder of its tokenizer, or None (a model
    without one); kept, or cleared, whenever a model is.  ``data_prefix`` belongs to ``train``: the
    Megatron ``.bin/.idx`` prefix the ranks read its text ``data`` from (None: mock tokens, instruction
    rows, or a cell that trained nothing); kept, or cleared, whenever a training setting is.

    Set by each training's run records (the ranks' merged settings: the only source of what a cell
    trained) and by ``%%megatron`` cells that trained nothing, from their ``mnb.gpt(...)`` /
    ``mnb.train(...)`` calls with literal arguments; read by ``%mnb export``, so a layout found in
    the notebook goes to the cluster with the settings it was found with.
    """
    if model:
        _SETTINGS["model"] = dict(model)
        _SETTINGS["tokenizer"] = tokenizer
    if train:
        _SETTINGS["train"] = dict(train)
        _SETTINGS["data_prefix"] = data_prefix


def last_settings() -> dict[str, Any]:
    """``{"model": {...}, "train": {...}}``, each present once the notebook has used one."""
    return dict(_SETTINGS)
