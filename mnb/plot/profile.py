"""plot_profile_timeline, plot_profile_memory: the figures of a merged profile (``mnb.last_profile``).

Drawn from plain data that :class:`mnb.notebook.profiles.Profile` computes (its ``timeline_rows`` and
``thread_names``, one rank's ``memory()`` series); ``Profile.plot`` and ``Profile.plot_memory`` call
these.  Each returns the Axes.
"""

from __future__ import annotations

from typing import Any

from ._figure import new_axes

MEMORY_LAYERS = ("weights", "gradients", "optimizer", "activations", "other")


def plot_profile_timeline(rows: dict[tuple[int, Any], dict[str, list]], names: dict[tuple[int, Any], str],
                          range: tuple[float, float] | None = None, ax=None):  # noqa: A002 - Profile.plot's name
    """One row per (rank, thread) of ``rows`` (``{"compute": [(start_ms, ms)], "comm": [...]}``), compute
    in blue and collectives in red, on the ranks' shared clock; ``names``: each thread's name."""
    keys = sorted(rows, key=lambda k: (k[0], str(k[1])))
    if ax is None:
        _, ax = new_axes(figsize=(12, 0.5 + 0.4 * max(len(keys), 1)))
    for y, key in enumerate(keys):
        bars = rows[key]
        ax.broken_barh(bars["compute"], (y - 0.4, 0.8), color="tab:blue", alpha=0.5)
        ax.broken_barh(bars["comm"], (y - 0.4, 0.8), color="tab:red")
    ax.set_yticks([i for i, _ in enumerate(keys)])
    ax.set_yticklabels([f"rank {r} · {(names.get((r, t)) or f'thread {t}')[:32]}" for r, t in keys])
    if range:
        ax.set_xlim(*range)
    ax.set_xlabel("ms on the shared host clock (blue: compute, red: collectives)")
    ax.invert_yaxis()
    return ax


def plot_profile_memory(memory: dict[str, Any], rank: int, predicted_peak_bytes: float | None = None, ax=None):
    """One rank's memory over the profiled steps (a ``Profile.memory()`` entry), stacked by category, the
    peak marked; ``predicted_peak_bytes`` as a dashed line when given."""
    unit, scale = ("GiB", 2**30) if memory["peak_bytes"] >= 2**30 else ("MiB", 2**20)
    count = len(memory["times_ms"])
    layers = [[v / scale for v in (memory[n] if isinstance(memory[n], list) else [memory[n]] * count)]
              for n in MEMORY_LAYERS]
    if ax is None:
        _, ax = new_axes(figsize=(9, 4))
    ax.stackplot(memory["times_ms"], *layers, labels=MEMORY_LAYERS, step="post", alpha=0.8)
    # the total as a line too: a spike narrower than a pixel still reaches its height
    ax.plot(memory["times_ms"], [sum(v) for v in zip(*layers)], color="k", linewidth=0.5, drawstyle="steps-post")
    ax.plot([memory["peak_ms"]], [memory["peak_bytes"] / scale], "kv",
            label=f"peak {memory['peak_bytes'] / scale:.3f} {unit} at {memory['peak_ms']:.1f} ms")
    if predicted_peak_bytes:
        ax.axhline(predicted_peak_bytes / scale, color="k", linestyle="--", label="predicted peak (mnb.estimate)")
    ax.set_xlabel("ms on the shared host clock")
    ax.set_ylabel(f"{unit} ({memory['source']})")
    ax.set_title(f"rank {rank}: memory over the profiled steps")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return ax
