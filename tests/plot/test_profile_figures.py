"""The merged profile's figures (mnb.plot.profile) from the plain data a Profile computes, without a pool:
the memory series of one rank and the timeline's rows."""

from __future__ import annotations

from matplotlib.figure import Figure

from mnb.plot.profile import plot_profile_memory, plot_profile_timeline

MEMORY = {"times_ms": [0.0, 1.0, 2.0, 3.0], "weights": 4 * 2**20, "gradients": 4 * 2**20, "optimizer": 8 * 2**20,
          "activations": [0, 6 * 2**20, 3 * 2**20, 0], "other": [0, 2**20, 0, 0],
          "peak_bytes": 23 * 2**20, "peak_ms": 1.0, "source": "counted tensors"}


def test_the_memory_figure_stacks_the_components_and_marks_the_peak_and_the_prediction():
    ax = plot_profile_memory(MEMORY, 1, predicted_peak_bytes=20 * 2**20)
    assert isinstance(ax.figure, Figure)  # outside a kernel: a bare figure, pyplot untouched
    assert ax.get_ylabel() == "MiB (counted tensors)" and ax.get_title() == "rank 1: memory over the profiled steps"
    peak = next(line for line in ax.get_lines() if str(line.get_label()).startswith("peak"))
    assert peak.get_ydata()[0] == 23.0 and peak.get_label() == "peak 23.000 MiB at 1.0 ms"
    predicted = next(line for line in ax.get_lines() if line.get_label() == "predicted peak (mnb.estimate)")
    assert list(predicted.get_ydata()) == [20.0, 20.0]
    assert [text.get_text() for text in ax.get_legend().get_texts()][:5] == [
        "weights", "gradients", "optimizer", "activations", "other"]


def test_the_timeline_has_a_row_per_thread_named_and_draws_into_a_given_axes():
    rows = {(1, 7): {"compute": [(0.0, 1.0)], "comm": [(1.0, 0.5)]}, (0, 7): {"compute": [(0.2, 0.3)], "comm": []}}
    names = {(0, 7): "python main", (1, 7): "python main"}
    ax = Figure().subplots()
    assert plot_profile_timeline(rows, names, (0.0, 2.0), ax=ax) is ax
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 · python main", "rank 1 · python main"]
    assert ax.get_xlim() == (0.0, 2.0)
