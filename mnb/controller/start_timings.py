"""Where a pool's start went, stage by stage: what ``%mnb start --timings`` prints.

Each rank sends the wall-clock intervals of its own start in its hello (mnb/worker/startup.py);
the pool adds the moments it launched torchrun and received the hello.  On the pool's own host
both ends read the same clock, so torchrun's share (its agent, the rendezvous, spawning the
rank) is the gap from the launch to the rank's process creation.  A stage still running when the
rank said hello (Megatron-Core's import, ``mnb/worker/late_start.py``) is shown as such: the pool
is ready, and the first cell waits for it.  For ranks on other hosts
only their own stages are shown (their clocks may differ).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str
    began_s: float
    """Seconds after torchrun was launched."""
    seconds: float
    """How long it took; for a stage still running at the hello, how long it had run by then."""
    running: bool = False
    """Still running when the rank said hello (Megatron-Core's import: the first cell waits for it)."""


def rank_stages(launched_at: float, startup: dict, received_at: float, local: bool) -> list[Stage]:
    """The stages of one rank's start, in the order they began, relative to the launch."""
    origin = launched_at if local else startup["process_started"]
    stages = []
    if local:
        stages.append(Stage("torchrun: agent, rendezvous, spawn", 0.0, startup["process_started"] - launched_at))
    for name, began, ended in startup.get("stages", []):
        stages.append(Stage(name, began - origin, ended - began))
    sent = startup.get("hello_sent", received_at)
    for name, began in startup.get("running", []):
        stages.append(Stage(name, began - origin, max(0.0, sent - began), running=True))
    if local:
        stages.append(Stage("hello reaches the notebook", sent - origin, received_at - sent))
    return sorted(stages, key=lambda s: s.began_s)


def format_stages(stages: list[Stage], total_s: float, rank: int) -> str:
    """A table of one rank's stages; overlapping stages (helper threads) show as such."""
    width = max([len(s.name) for s in stages] + [5])
    lines = [f"start-up of rank {rank} (the last to be ready), seconds after torchrun was launched:",
             f"  {'stage':<{width}}  {'from':>6}  {'took':>6}"]
    end = 0.0
    for stage in stages:
        overlap = "  (overlaps the stage above)" if stage.began_s < end - 0.05 else ""
        if stage.running:
            lines.append(f"  {stage.name:<{width}}  {stage.began_s:6.2f}  {'...':>6}  (still running at the hello, "
                         f"{stage.seconds:.2f} s so far: the first cell waits for it)")
            end = max(end, stage.began_s + stage.seconds)
            continue
        lines.append(f"  {stage.name:<{width}}  {stage.began_s:6.2f}  {stage.seconds:6.2f}{overlap}")
        end = max(end, stage.began_s + stage.seconds)
    lines.append(f"  {'ready (every rank said hello)':<{width}}  {total_s:6.2f}")
    return "\n".join(lines)
