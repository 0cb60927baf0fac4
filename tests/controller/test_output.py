import time

from mnb.controller.output import LineFolder, coords_label
from mnb.errors import CompositeRankError, RankError, format_rank_set


def collect():
    out = []
    return out, lambda name, text: out.append((name, text))


def test_identical_lines_of_all_ranks_fold_into_one():
    out, write = collect()
    folder = LineFolder([0, 1, 2, 3], {r: f"r{r} tp{r % 2}" for r in range(4)}, write)
    for rank in range(4):
        folder.feed(rank, "stdout", "built model\n")
    folder.flush()
    assert out == [("stdout", "[r0-3] built model\n")]


def test_different_lines_are_labelled_by_rank_and_coordinates():
    out, write = collect()
    folder = LineFolder([0, 1], {0: "r0 tp0 pp0 dp0", 1: "r1 tp1 pp0 dp0"}, write)
    folder.feed(0, "stdout", "rank 0\n")
    folder.feed(1, "stdout", "rank 1\n")
    folder.flush()
    assert "".join(t for _, t in out) == "[r0 tp0 pp0 dp0] rank 0\n[r1 tp1 pp0 dp0] rank 1\n"


def test_partial_lines_are_joined_and_lonely_lines_released_after_window():
    out, write = collect()
    folder = LineFolder([0, 1], {0: "r0", 1: "r1"}, write, fold_window_s=0.05)
    folder.feed(0, "stdout", "hel")
    folder.feed(0, "stdout", "lo\n")
    assert out == []  # waiting for rank 1 to print the same line
    time.sleep(0.06)
    folder.poll()
    assert out == [("stdout", "[r0] hello\n")]
    folder.feed(1, "stderr", "no newline")
    folder.flush()
    assert out[-1] == ("stderr", "[r1] no newline\n")


def test_coords_label_shows_cp_ep_only_when_used():
    coords = {"tp": 1, "pp": 0, "dp": 1, "cp": 0, "ep": 1}
    assert coords_label(3, coords, {"cp": 1, "ep": 1}) == "r3 tp1 pp0 dp1"
    assert coords_label(3, coords, {"cp": 1, "ep": 2}) == "r3 tp1 pp0 dp1 ep1"


def test_rank_sets_and_folded_tracebacks():
    assert format_rank_set([0, 1, 2, 3]) == "r0-3"
    assert format_rank_set([0, 2, 3, 5]) == "r0,2-3,5"
    errors = [RankError(rank=r, ename="ValueError", evalue="bad", traceback="TB same\n", label=f"r{r}")
              for r in (0, 1, 3)]
    errors.append(RankError(rank=2, ename="KeyError", evalue="'x'", traceback="TB other\n", label="r2 tp0"))
    composite = CompositeRankError(errors, cell_ranks=[0, 1, 2, 3])
    assert len(composite.groups()) == 2
    rendered = "\n".join(composite._render_traceback_())
    assert "4 of 4 ranks raised" in rendered
    assert "[r0-1,3]" in rendered and "[r2 tp0]" in rendered
    assert rendered.count("TB same") == 1


def test_flushing_before_what_one_rank_shows_leaves_other_ranks_lines_to_fold():
    """mnb.generate's text comes from rank 0: flushing every rank's lines before it (as every
    ``generate`` event did) printed rank 1's line that arrived before rank 0's copy alone, unfolded."""
    out, write = collect()
    folder = LineFolder([0, 1], {0: "r0", 1: "r1"}, write, fold_window_s=600)
    folder.feed(0, "stdout", "before\n")
    folder.feed(1, "stdout", "before\n")
    assert out == [("stdout", "[r0-1] before\n")]
    folder.feed(1, "stdout", "after\n")  # rank 1 printed it before rank 0's generated text arrived
    folder.flush(0)  # rank 0 shows its text now: nothing of rank 0's waits, rank 1's line stays
    assert out == [("stdout", "[r0-1] before\n")]
    folder.feed(0, "stdout", "after\n")
    assert out[-1] == ("stdout", "[r0-1] after\n")
    folder.feed(0, "stdout", "loading\nhalf a li")  # rank 0's own lines go out before what it shows
    folder.flush(0)
    assert out[-1] == ("stdout", "[r0] loading\n[r0] half a li\n")
    folder.feed(1, "stdout", "other")
    folder.flush()  # everything, as a cell's end does
    assert out[-1] == ("stdout", "[r1] other\n")
