"""Which warnings go to the pool's log: a notice known as noise only where a library raises it."""

from __future__ import annotations

import os

from mnb.worker.quiet_warnings import is_quiet

NON_LEAF = ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad attribute "
            "won't be populated during autograd.backward().")


def test_megatrons_non_leaf_grad_notice_is_quiet_only_from_its_optimizer():
    megatron = os.path.join("site-packages", "megatron", "core", "optimizer", "optimizer.py")
    assert is_quiet(NON_LEAF, megatron)
    assert not is_quiet(NON_LEAF, "/home/me/<ipython-input-3>")  # the user's own mistake still shows
    assert not is_quiet("something else", megatron)
    assert is_quiet("Apex is not installed", "/anywhere.py")  # the message-only notices as before


def test_a_background_threads_prints_warnings_and_log_records_go_to_the_log_not_the_cell():
    """LateStart's import thread runs while a cell waits: what it says is the start's, not the cell's."""
    import io
    import logging
    import sys
    import threading
    import warnings

    from mnb.worker.capture import RankStream, write_this_thread_to_log

    sent, log = [], io.StringIO()
    stream = RankStream("stderr", sent.append, 0, sys.__stderr__)  # fallback: fd 2, the cell's pipe on a rank
    stream.cell_id = "cell-1"

    def background():
        write_this_thread_to_log()
        print("import notice", file=sys.stderr)
        warnings.warn("a library's import warning")
        logger.warning("a library's log record")

    def written_to_stderr(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    saved, saved_log = sys.stderr, sys.__stderr__
    sys.stderr, sys.__stderr__ = stream, log  # the rank's log (FdCapture moves it to its own descriptor)
    logger = logging.getLogger("some.library")
    handler = logging.StreamHandler()  # a library's own handler, bound to the rank's sys.stderr
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = written_to_stderr  # as Python's own does (pytest records them instead)
            thread = threading.Thread(target=background)
            thread.start()
            thread.join()
        print("the cell's own line", file=sys.stderr)
    finally:
        sys.stderr, sys.__stderr__ = saved, saved_log
        logger.removeHandler(handler)
    assert [(m["cell"], m["text"]) for m in sent] == [("cell-1", "the cell's own line"), ("cell-1", "\n")]
    for line in ("import notice", "a library's import warning", "a library's log record"):
        assert line in log.getvalue()
