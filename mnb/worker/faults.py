"""Every thread's Python stack on a fatal signal, where the controller can read it.

A rank killed by SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL sends no message: the notebook only
learns the signal from its exit status.  Which Python line it was on is what the user needs next
(a ``ctypes`` call, a collective whose C++ thread aborted, an extension's bug).  Python's own
:mod:`faulthandler` writes it from inside the signal handler, with no Python code running; here it
writes into the pool's exits folder (:func:`mnb.protocol.fault_file`), not into the rank's stderr,
which is a pipe whose last bytes die with the process (:class:`mnb.worker.capture.FdCapture`).
"""

from __future__ import annotations

import faulthandler
import os

from mnb.protocol import EXITS_DIR_ENV, fault_file

_open_file = None
"""The open fault file: faulthandler keeps only its descriptor, so the file object must live on."""


def record_fatal_stacks(rank: int) -> None:
    """Have :mod:`faulthandler` write all threads' stacks to this rank's fault file on a fatal signal.

    Without the launcher's exits folder (a rank started by hand) nothing changes.
    """
    global _open_file
    folder = os.environ.get(EXITS_DIR_ENV)
    if not folder:
        return
    path = fault_file(folder, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "w", encoding="utf-8")
    except OSError:  # the report then names the signal only, as before
        return
    faulthandler.enable(file=handle, all_threads=True)
    if _open_file is not None:
        _open_file.close()
    _open_file = handle
