"""``%mnb debug`` on the rank: the last failed cell's exception, kept with its frames, and pdb on it.

Kept out of ``mnb/worker/main.py`` (the rank's message loop).  A failed cell's exception is
kept on the rank (``Rank.last_failure``) until its next cell, which releases its frames first
(:func:`forget_failure`), so a kept exception cannot pin a failed step's tensors past it.
``%mnb debug`` arrives as an ``execute`` with ``post_mortem`` set: :func:`post_mortem` runs
pdb on the kept frames with prompts and answers through the notebook's stdin
(:mod:`mnb.worker.stdin`), and the kept failure stays for another look.
"""

from __future__ import annotations

import sys
from typing import Any

from mnb.protocol import Message
from mnb.worker import stdin
from mnb.worker.executor import Outcome, describe_exception, release_frames, run_cell


def forget_failure(rank: Any) -> None:
    """The next cell: the failed one's frames (and tensors) go."""
    if rank.last_failure is not None:
        release_frames(rank.last_failure)
        rank.last_failure = None


def post_mortem(rank: Any, message: Message) -> None:
    """pdb on the frame where this rank's last cell failed, through the notebook's stdin."""
    failure, outcome = rank.last_failure, Outcome(ok=True)
    if failure is not None:
        print(f"post-mortem of {type(failure).__name__}: {failure}", flush=True)
        with stdin.forwarded(rank.channel, rank.rank, message.id, None):
            try:
                stdin.post_mortem(failure, skip_file=sys.modules[run_cell.__module__].__file__)
            except BaseException as exc:  # no stdin, an interrupt: the request's error
                outcome = describe_exception(exc)
    rank.end_cell()
    rank.reply_cell(message, outcome, kept=failure is not None)
