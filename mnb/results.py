"""What mnb's calls return, readable as a cell's last value: the data as before, the repr one line.

``mnb.train(...)`` as a cell's last line used to print each rank's whole run record, several
kilobytes of dict.  :class:`TrainResult` is that record (a ``dict``, the same keys:
``run["losses"]``-style reads, ``json.dumps``, ``dict(run)`` all unchanged) whose repr is
one line::

    <mnb.train rank 0 (tp1 pp0 dp0): 10 steps (1-10), loss 5.5452 -> 4.1230, 1,234 tokens/s, peak 38.2 MiB>

:class:`LoadResult` does the same for ``mnb.load``.  Standard library only: made on the ranks,
rebuilt in the notebook kernel (``mnb.values`` lets these classes travel).
"""

from __future__ import annotations

from typing import Any

from mnb.units import format_bytes


class _OneLine(dict):
    """A dict whose repr is :meth:`line` in angle brackets (``_repr_pretty_`` too, for IPython)."""

    def line(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        try:
            return f"<{self.line()}>"
        except Exception as exc:  # a record missing fields still shows, as what it is
            return f"<{type(self).__name__} with keys {sorted(self)} ({type(exc).__name__}: {exc})>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))


class TrainResult(_OneLine):
    """This rank's run record from ``mnb.train`` (schema in :mod:`mnb.megatron.record`).

    Besides the record's keys, the per-step series read as keys and attributes, as on
    ``mnb.last_run``: ``run["losses"]``, ``run.lrs``, ``step_times_s``, ``tokens_per_s``
    (derived from ``steps``, not stored: the record and its JSON are unchanged).
    """

    SERIES = {"losses": "loss", "lrs": "lr", "grad_norms": "grad_norm", "step_times_s": "step_time_s",
              "tokens_per_s": "tokens_per_s"}

    def __missing__(self, key: str) -> list:
        if key in self.SERIES and "steps" in self:
            return [row.get(self.SERIES[key]) for row in self["steps"]]
        raise KeyError(key)

    @property
    def losses(self) -> list:
        return self["losses"]

    @property
    def lrs(self) -> list:
        return self["lrs"]

    def line(self) -> str:
        rows = self.get("steps") or []
        coords = self.get("coords") or {}
        where = " ".join(f"{k}{coords[k]}" for k in ("tp", "pp", "dp") if k in coords)
        head = f"mnb.train rank {self.get('rank', '?')}" + (f" ({where})" if where else "")
        if not rows:
            return f"{head}: no steps"
        parts = [f"{len(rows)} steps ({rows[0].get('step')}-{rows[-1].get('step')})"]
        losses = [r["loss"] for r in rows if r.get("loss") is not None]
        if losses:
            parts.append(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
        rates = [r["tokens_per_s"] for r in rows[1:] or rows if r.get("tokens_per_s")]
        if rates:
            parts.append(f"{sum(rates) / len(rates):,.0f} tokens/s")
        peak = (self.get("memory_components") or {}).get("peak") or (self.get("memory") or {}).get(
            "peak_allocated_bytes")
        if peak:
            parts.append(f"peak {format_bytes(peak)}")
        return f"{head}: " + ", ".join(parts)


class LoadResult(_OneLine):
    """What ``mnb.load`` returns: the checkpoint's ``mnb.json`` plus what was loaded."""

    def line(self) -> str:
        layout = self.get("layout") or {}
        saved = " ".join(f"{k}{layout[k]}" for k in ("tp", "pp", "vpp", "dp") if k in layout
                         and (k != "vpp" or (layout[k] or 1) > 1))
        loaded = [name for name, key in (("optimizer", "optimizer_loaded"), ("schedule", "schedule_loaded"),
                                         ("rng", "rng_loaded")) if self.get(key)]
        text = f"mnb.load {self.get('path', '?')}: step {self.get('step')}"
        if saved:
            text += f", saved under {saved}"
        return text + f"; weights{''.join(', ' + n for n in loaded)} loaded"
