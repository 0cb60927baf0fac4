"""The profiler's step syntax: which steps of a cell's training ``--profile STEPS`` / ``profile=`` names.

Read on both sides with one rule: the magic checks ``%%megatron --profile 3-4`` before any rank is
touched (:mod:`mnb.notebook.profile_commands`), the ranks read the same text when they profile
(:mod:`mnb.megatron.profile`).  Level 1: imports nothing of mnb.
"""

from __future__ import annotations

from typing import Any


def parse_steps(steps: Any) -> tuple[int, int] | None:
    """``3`` -> (3, 3); ``"3-4"`` -> (3, 4); None or "" -> None (the default).  Steps count from 1 within the call."""
    if steps is None or steps == "":
        return None
    if isinstance(steps, bool):
        raise ValueError("profile= takes steps like 3 or '3-4' (counted from 1 within the call)")
    if isinstance(steps, int):
        first = last = steps
    else:
        first_text, _, rest = str(steps).strip().partition("-")
        try:
            first, last = int(first_text), int(rest or first_text)
        except ValueError:
            raise ValueError(f"profile={steps!r}: give steps like 3 or '3-4' (counted from 1 within the call)") from None
    if first < 1 or last < first:
        raise ValueError(f"profile={steps!r}: steps count from 1 and the last comes after the first, e.g. '2-3'")
    return first, last
