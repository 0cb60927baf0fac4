"""Run a cell's code in the rank's persistent namespace.

The cell is parsed like IPython does it: if its last statement is an
expression, that expression's value is the cell's result (assigned to a
private name inside the same code object, so a debugger steps onto it).  The source is
registered with ``linecache`` under the cell's file name, ``<cell-N>``, so tracebacks and
stack dumps show the cell's own lines.  ``N`` is the controller's number for the request
(one per ``execute``, the same on every rank), never a count of this rank's own: a cell run
on some ranks only would otherwise number the next cell differently on each rank, and its
identical tracebacks would no longer fold.
"""

from __future__ import annotations

import ast
import linecache
import traceback
from dataclasses import dataclass
from typing import Any

from mnb.paths import in_mnb

_RESULT = "_mnb_cell_value_"
"""The name the cell's last expression is assigned to while the cell runs (then removed)."""


@dataclass
class Outcome:
    ok: bool
    value: Any = None
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    exception: BaseException | None = None
    """The failure itself, only with ``run_cell(keep_failure=True)``: its frames are kept for ``%mnb debug``."""


def run_cell(code: str, namespace: dict[str, Any], keep_failure: bool = False, *, number: int) -> Outcome:
    """Execute ``code`` as ``<cell-{number}>``; never raises (errors come back as an Outcome).

    ``number``: the request's cell number, from the controller (``execute``'s ``number``).

    ``keep_failure``: a failure keeps its frames (``Outcome.exception``) for a post-mortem
    (``%mnb debug``); the caller releases them (:func:`release_frames`) before the next cell.
    """
    filename = f"<cell-{number}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    try:
        tree = ast.parse(code, filename=filename)
        has_value = bool(tree.body) and isinstance(tree.body[-1], ast.Expr)
        if has_value:  # one code object: pdb's `n` steps from a breakpoint() onto the last line as written
            last = tree.body[-1]
            tree.body[-1] = ast.copy_location(
                ast.Assign(targets=[ast.Name(id=_RESULT, ctx=ast.Store())], value=last.value), last)
            ast.fix_missing_locations(tree)
        namespace.pop(_RESULT, None)
        try:
            exec(compile(tree, filename, "exec"), namespace)
        finally:
            value = namespace.pop(_RESULT, None)
        if ends_with_semicolon(code):  # IPython's convention: a trailing ';' hides the result
            value = None
        return Outcome(ok=True, value=value)
    except BaseException as exc:  # the rank reports every failure, KeyboardInterrupt included
        outcome = describe_exception(exc)
        if keep_failure:
            outcome.exception = exc
        else:
            release_frames(exc)
        return outcome


def ends_with_semicolon(code: str) -> bool:
    """Whether the cell's last token, comments and blank lines left out, is ``;`` (IPython's rule:
    ``mnb.train(...);  # quiet`` hides the result as ``mnb.train(...);`` does)."""
    import io
    import tokenize

    last = None
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            if token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                  tokenize.DEDENT, tokenize.ENDMARKER):
                last = token
    except (tokenize.TokenError, SyntaxError):  # the cell ran, so it parsed; be safe anyway
        return code.rstrip().endswith(";")
    return last is not None and last.type == tokenize.OP and last.string == ";"


def release_frames(exc: BaseException) -> None:
    """Drop the local variables of the finished frames behind ``exc`` (and its causes).

    A failed training step's frames hold its activations, the model and its optimizer; any
    library that keeps the exception (a logger, a retry helper) would keep all of that alive
    through the next cell.  The traceback text is already taken; only ``%mnb debug`` reads
    these frames again, until the rank's next cell (``mnb.worker.debugging`` releases them then).  (The 137 GiB an H200 kept after an out-of-memory error had another
    cause, fixed in ``mnb.megatron.memory``: this alone did not release it.)
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _text_of(exc: BaseException) -> str:
    """``str(exc)``, or what the traceback module shows when the exception's own ``__str__`` raises (a user
    trial's did: the cell failed with mnb's frames instead of its own error)."""
    try:
        return str(exc)
    except Exception as err:  # noqa: BLE001 - any failure of the user's __str__
        return f"<exception str() failed: {type(err).__name__}: {err}>"


def describe_exception(exc: BaseException) -> Outcome:
    """Plain-data description of an exception, mnb's own frames removed.

    A debugger's own ending (pdb's ``q``: ``BdbQuit``; no stdin: ``NoStdinError``) is shown
    without pdb's, bdb's and mnb's stdin frames: what is left is where the cell stood.
    """
    tb = exc.__traceback__
    # Drop the frames of this module so the traceback starts in the cell.
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    hidden = _debugger_files() if type(exc).__name__ in ("BdbQuit", "NoStdinError") else ()
    if _refused_by_mnb(exc, tb):
        text = _refusal_text(exc, traceback.extract_tb(tb))
    elif hidden:
        frames = [f for f in traceback.extract_tb(tb) if f.filename not in hidden]
        text = (("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))) if frames else ""
                ) + "".join(traceback.format_exception_only(type(exc), exc))
    else:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    return Outcome(ok=False, ename=type(exc).__name__, evalue=_text_of(exc), traceback=text)


def _refused_by_mnb(exc: BaseException, tb) -> bool:
    """A ValueError, TypeError or FileNotFoundError that mnb's own checks raised (its innermost frame is mnb's),
    with no chained exception to show: the user's input was refused."""
    frames = traceback.extract_tb(tb)
    return (isinstance(exc, (ValueError, TypeError, FileNotFoundError)) and bool(frames) and in_mnb(frames[-1].filename)
            and exc.__cause__ is None and (exc.__context__ is None or exc.__suppress_context__))


def _refusal_text(exc: BaseException, frames: traceback.StackSummary) -> str:
    """The traceback of a refusal: the user's frames and the line that raised; each run of mnb's frames between
    them is one line (how the check was reached is not where to change anything)."""
    lines = ["Traceback (most recent call last):\n"]
    skipped = 0
    for index, frame in enumerate(frames):
        if in_mnb(frame.filename) and index < len(frames) - 1:
            skipped += 1
            continue
        if skipped:
            lines.append(f"  ... {skipped} frame(s) inside mnb ...\n")
            skipped = 0
        lines.extend(traceback.format_list([frame]))
    return "".join(lines) + "".join(traceback.format_exception_only(type(exc), exc))


def _debugger_files() -> set[str]:
    """The files of pdb, bdb, cmd and mnb's stdin forwarding (with the exec loop that runs a post-mortem)."""
    import bdb
    import cmd
    import pdb
    import sys

    files = {bdb.__file__, cmd.__file__, pdb.__file__}
    for name in ("mnb.worker.stdin", "mnb.worker.debugging", "mnb.worker.main"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            files.add(module.__file__)
    return files


def portable(value: Any) -> Any:
    """A copy of ``value`` the notebook kernel can unpickle without torch.

    :func:`mnb.values.kernel_safe`: tensors become numpy arrays (bf16/fp8 via
    float32), containers are converted recursively, and anything the kernel
    could not rebuild (torch/Megatron objects, functions, classes defined in
    cells, values that do not pickle) becomes an ``Unportable`` note holding
    its repr and the reason, so pulling a value never breaks the kernel.
    """
    from mnb import values

    return values.kernel_safe(value)
