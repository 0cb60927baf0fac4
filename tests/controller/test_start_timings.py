"""``%mnb start --timings``: the stages of a rank's start, lined up against the launch."""

from __future__ import annotations

import re

import pytest

from mnb.controller.start_timings import format_stages, rank_stages

LAUNCH = 1000.0
# A CUDA rank: Megatron's import runs in a helper thread beside CUDA's and NCCL's initialisation.
CUDA_RANK = {
    "process_started": 1002.0,
    "stages": [["interpreter and mnb.worker", 1002.0, 1002.5], ["torch import", 1002.5, 1004.5],
               ["Megatron-Core import", 1004.6, 1009.0], ["CUDA init", 1004.6, 1007.0],
               ["process group (nccl)", 1007.0, 1008.0], ["mnb: layout and recording", 1009.0, 1009.2]],
    "hello_sent": 1009.3,
}


def _rows(text: str) -> list[tuple[str, float, float | None]]:
    rows = []
    for line in text.splitlines()[2:]:
        match = re.match(r"\s+(.+?)\s+(\d+\.\d\d)(?:\s+(\d+\.\d\d))?", line)
        rows.append((match.group(1), float(match.group(2)), match.group(3) and float(match.group(3))))
    return rows


def test_stages_start_at_the_launch_and_overlaps_are_marked():
    stages = rank_stages(LAUNCH, CUDA_RANK, received_at=1009.4, local=True)
    assert stages[0].name.startswith("torchrun") and stages[0].seconds == pytest.approx(2.0)
    assert [s.began_s for s in stages] == sorted(s.began_s for s in stages)
    text = format_stages(stages, total_s=9.4, rank=1)
    lines = {line.split("  ")[1].strip(): line for line in text.splitlines()[2:]}
    assert "overlaps" in lines["CUDA init"] and "overlaps" not in lines["torch import"]
    assert lines["hello reaches the notebook"].split()[-2:] == ["9.30", "0.10"]
    assert _rows(text)[-1] == ("ready (every rank said hello)", 9.4, None)


def test_a_remote_rank_shows_only_its_own_stages_from_its_own_start():
    stages = rank_stages(LAUNCH - 50, CUDA_RANK, received_at=0.0, local=False)  # another host's clock
    assert not any(s.name.startswith(("torchrun", "hello")) for s in stages)
    assert stages[0].began_s == 0.0 and stages[-1].began_s == pytest.approx(7.0)


def test_a_stage_still_running_at_the_hello_is_shown_as_such():
    # Megatron-Core's import goes on after the hello (mnb/worker/late_start.py): the pool is ready first
    rank = {"process_started": 1002.0,
            "stages": [["interpreter and mnb.worker", 1002.0, 1002.5], ["torch import", 1002.5, 1004.5],
                       ["process group (gloo)", 1004.6, 1005.0]],
            "running": [["Megatron-Core import and CPU redirection", 1004.55]], "hello_sent": 1005.1}
    stages = rank_stages(LAUNCH, rank, received_at=1005.2, local=True)
    running = [s for s in stages if s.running]
    assert [s.name for s in running] == ["Megatron-Core import and CPU redirection"]
    assert running[0].seconds == pytest.approx(0.55)  # by the hello
    text = format_stages(stages, total_s=5.2, rank=0)
    line = next(line for line in text.splitlines() if "Megatron-Core" in line)
    assert "4.55     ...  (still running at the hello, 0.55 s so far: the first cell waits for it)" in line, line
    assert "overlaps" in next(line for line in text.splitlines() if "process group" in line)
