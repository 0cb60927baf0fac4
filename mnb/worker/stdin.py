"""A cell's ``input()``, ``getpass``, ``sys.stdin``, ``breakpoint()`` and pdb on a rank, answered by the notebook.

A rank has no terminal: its stdin is torchrun's.  While a cell runs, :func:`forwarded`
replaces ``builtins.input``, ``getpass.getpass``, ``sys.stdin``, ``sys.breakpointhook`` and
``pdb.set_trace`` with readers that send one signed ``input_request`` (prompt, password
flag) over the rank's channel and block until the controller's ``input_reply``; the
controller asks the notebook's own stdin (Jupyter's ``input_request``), labelled with the
rank (``mnb/controller/stdin.py``).  Everything is put back after the cell.

pdb runs with ``use_rawinput`` (it calls ``input("(Pdb) ")``, i.e. the reader) and writes
to the cell's stdout.  ``breakpoint()`` and ``pdb.set_trace()`` stop only on the ranks the
cell's ``--debug-ranks`` names (every rank without it).  A front-end without stdin
(nbclient, ``allow_stdin=False``) makes the reader raise :class:`NoStdinError` at once, also
inside pdb (pdb would turn an ``EOFError`` into a silent quit); an interrupt while a rank
waits raises ``KeyboardInterrupt`` out of pdb too (pdb itself would only print
``--KeyboardInterrupt--`` and ask again).

``python -m mnb.worker`` installs it in ``Rank._on_execute``; ``%mnb debug`` reuses
:func:`post_mortem` on the kept traceback (``mnb.worker.debugging``).
"""

from __future__ import annotations

import builtins
import contextlib
import getpass
import io
import pdb
import sys
import threading
import uuid
from typing import Any, Iterator

from mnb.errors import NoStdinError
from mnb.protocol import Message


class _Reader:
    """Sends one ``input_request`` per line asked for and waits for its answer (one at a time per rank)."""

    def __init__(self, channel: Any, rank: int, cell_id: str | None):
        self.channel = channel
        self.rank = rank
        self.cell_id = cell_id
        self._lock = threading.Lock()

    def ask(self, prompt: str = "", password: bool = False) -> str:
        for stream in (sys.stdout, sys.stderr):  # what the cell printed goes before the prompt
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        with self._lock:
            request = Message("input_request", id=uuid.uuid4().hex[:12],
                              header={"rank": self.rank, "cell": self.cell_id, "prompt": str(prompt),
                                      "password": bool(password)})
            self.channel.send(request)
            while True:
                answer = self.channel.answers.get()  # an interrupt (SIGINT) raises KeyboardInterrupt here
                if answer.id == request.id:
                    break  # an answer to an earlier, interrupted request is dropped
        error = answer.get("error")
        if error == "no-stdin":
            raise NoStdinError(answer.get("text") or "the notebook's front-end does not answer input()")
        if error == "eof":
            raise EOFError(answer.get("text") or "input ended")
        if error:
            raise KeyboardInterrupt(answer.get("text") or "the cell is being stopped")
        return answer.get("value") or ""


class RankStdin(io.TextIOBase):
    """``sys.stdin`` of a rank during a cell: each ``readline`` asks the notebook for one line."""

    def __init__(self, reader: _Reader):
        self._reader = reader

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        try:
            return self._reader.ask("") + "\n"
        except EOFError:
            return ""

    def read(self, size: int | None = -1) -> str:
        return self.readline()

    def isatty(self) -> bool:
        return False


class RankPdb(pdb.Pdb):
    """pdb that lets an interrupt end the cell (instead of printing ``--KeyboardInterrupt--``).

    Stepping never stops in mnb's exec loop (``mnb.worker.*``): ``n`` past a cell's last statement
    goes on to the cell's last expression, as the user wrote it, not into ``executor.py``.
    """

    def __init__(self) -> None:
        super().__init__(skip=["mnb.worker", "mnb.worker.*"])

    def _cmdloop(self) -> None:  # pdb.Pdb._cmdloop in 3.11 and 3.12 loops on KeyboardInterrupt
        self.allow_kbdint = True
        self.cmdloop()
        self.allow_kbdint = False


@contextlib.contextmanager
def forwarded(channel: Any, rank: int, cell_id: str | None, debug_ranks: list[int] | None) -> Iterator[_Reader]:
    """For one cell: input, getpass, sys.stdin and breakpoints of this rank go to the notebook."""
    reader = _Reader(channel, rank, cell_id)
    stops = debug_ranks is None or rank in debug_ranks

    def rank_input(prompt: Any = "") -> str:
        return reader.ask(str(prompt))

    def rank_getpass(prompt: str = "Password: ", stream: Any = None) -> str:
        return reader.ask(prompt, password=True)

    def rank_breakpointhook(*args: Any, **kwargs: Any) -> None:
        if stops:
            RankPdb().set_trace(sys._getframe(1))

    def rank_set_trace(*, header: str | None = None) -> None:
        if stops:
            debugger = RankPdb()
            if header is not None:
                debugger.message(header)
            debugger.set_trace(sys._getframe(1))

    saved = (builtins.input, getpass.getpass, sys.stdin, sys.breakpointhook, pdb.set_trace)
    builtins.input, getpass.getpass = rank_input, rank_getpass
    sys.stdin, sys.breakpointhook, pdb.set_trace = RankStdin(reader), rank_breakpointhook, rank_set_trace
    try:
        yield reader
    finally:
        builtins.input, getpass.getpass, sys.stdin, sys.breakpointhook, pdb.set_trace = saved


def post_mortem(exc: BaseException, skip_file: str) -> None:
    """pdb on the innermost frame of ``exc``'s traceback (inside :func:`forwarded`), like IPython's ``%debug``.

    ``skip_file``: the executor's own file, whose frames are not the user's.
    """
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == skip_file and tb.tb_next is not None:
        tb = tb.tb_next
    debugger = RankPdb()
    debugger.reset()
    debugger.interaction(None, tb)
