"""``%mnb run SCRIPT ARGS``: run a torchrun script unmodified inside a live rank.

What torchrun gives a script, the rank gives it too: ``__name__ == "__main__"``,
``__file__``, ``sys.argv == [SCRIPT, *ARGS]``, the script's folder first on
``sys.path``, and torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...: the rank *is* a torchrun
worker, so they are already set).  ``sys.modules["__main__"]`` is the script while
it runs, so pickling its functions and multiprocessing's spawn (dist_checkpointing's
helpers) find them.  What a live process cannot repeat (the default process group,
Megatron's parallel state) is adopted by :mod:`mnb.megatron.adopt`; on CPU ranks
the script's GPU idioms run on the CPU (:mod:`mnb.megatron.gpu_idioms`; one line in
the cell names those used).  Each run starts as clean as a fresh process -- its
modules, the notebook's directory and environment, library singletons
(:mod:`mnb.worker.sandbox`) -- and what it sets for the whole process is put back after it.

``sys.exit(0)`` (or ``sys.exit()``) is success; another exit code or an exception is
the rank's error.  Afterwards the script's globals join the rank's namespace, as
IPython's ``%run`` leaves them, except mnb's own names; ``sys.argv``, ``sys.path``,
``__main__``, the directory and ``os.environ`` are restored.  Not repeated: ``atexit`` handlers, and ``os._exit`` ends the rank.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys
import traceback
from typing import Any

from mnb.worker.executor import Outcome
from mnb.worker.sandbox import ScriptSandbox

_KEEP_OUT = frozenset({"__builtins__", "__name__", "__file__", "__doc__", "__spec__", "__loader__",
                       "__package__", "__cached__"})


def run_script(request: dict[str, Any], namespace: dict[str, Any], *, ranks: list[int], cpu_ranks: bool,
               kernel: dict[str, Any] | None = None) -> Outcome:
    """Run ``request["path"]`` with ``request["args"]`` on this rank; never raises (see module doc).

    ``kernel``: the notebook kernel's ``cwd`` and ``environ`` changes (:mod:`mnb.worker.sandbox`)."""
    path = os.path.abspath(request["path"])
    args = [str(a) for a in request.get("args") or []]
    if not os.path.isfile(path):
        return Outcome(ok=False, ename="FileNotFoundError",
                       evalue=f"no script {path} on this rank's host (ranks on other hosts need the same path)")
    from mnb.megatron.cpurun import script_builtins, script_module

    try:
        module, code = script_module(path)
    except (SyntaxError, OSError, UnicodeDecodeError, ValueError) as exc:
        return _failure(exc)
    module.__dict__["__builtins__"] = script_builtins() if cpu_ranks else builtins
    saved_argv, saved_path, saved_main = sys.argv, list(sys.path), sys.modules.get("__main__")
    sandbox = ScriptSandbox(path, namespace, kernel)
    notes: list[str] = []
    from mnb.megatron import adopt, cpu, gpu_idioms

    try:
        with sandbox:
            sys.argv = [path, *args]
            sys.path.insert(0, os.path.dirname(path))
            sys.modules["__main__"] = module
            redirect = gpu_idioms.ScriptRedirection() if cpu_ranks else contextlib.nullcontext()
            try:
                with adopt.adopted(ranks=ranks, cpu_ranks=cpu_ranks), redirect:
                    exec(code, module.__dict__)
            finally:
                notes = cpu.take_notes() if cpu_ranks else []
                sys.argv, sys.path[:] = saved_argv, saved_path
                if saved_main is not None:
                    sys.modules["__main__"] = saved_main
        outcome = Outcome(ok=True)
    except SystemExit as exc:
        outcome = _exit_outcome(exc)
    except BaseException as exc:  # the rank reports every failure, KeyboardInterrupt included
        outcome = _failure(exc)
        outcome.exception = exc  # kept for %mnb debug until the next cell, as a failed cell's (debugging.py)
    _keep_globals(module.__dict__, namespace)
    once = [gpu_idioms.summary_line(notes)] if min(ranks) == int(os.environ.get("RANK", "0")) else []
    for line in (*once, sandbox.restored_line(), sandbox.restore_names()):
        if line:
            print(line)
    return outcome


def restore_pool_state() -> Outcome:
    """After a script on every rank: the pool's layout again (a request of its own; see adopt.restore)."""
    try:
        from mnb.megatron import adopt

        adopt.restore()
        return Outcome(ok=True)
    except BaseException as exc:
        return _failure(exc)


def _keep_globals(script_ns: dict[str, Any], namespace: dict[str, Any]) -> None:
    """The script's names stay for later cells (like IPython's %run), torch as the real module."""
    from mnb.megatron import cpu

    namespace.update({k: cpu.real_torch(v) for k, v in script_ns.items() if k not in _KEEP_OUT})


def _exit_outcome(exc: SystemExit) -> Outcome:
    code = exc.code
    if code is None or code == 0:
        return Outcome(ok=True)
    if isinstance(code, int):
        return _failure(exc, evalue=f"the script exited with code {code}")
    return _failure(exc, evalue=f"the script exited: {code}")  # sys.exit("message") prints it, exits 1


def _failure(exc: BaseException, evalue: str | None = None) -> Outcome:
    """An error outcome whose traceback starts in the script (this module's frames dropped)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return Outcome(ok=False, ename=type(exc).__name__, evalue=evalue if evalue is not None else str(exc),
                   traceback=text)
