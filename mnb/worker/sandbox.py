"""A ``%mnb run`` starts as clean as a fresh process, and leaves the rank as it found it.

A live rank has state a fresh ``torchrun`` process would not have; the sandbox
(:class:`ScriptSandbox`, used by :mod:`mnb.worker.script`) removes or hides it for
the script's run, cheaply:

- **modules**: those from the script's folder are imported afresh (a cached
  ``model.py`` of another folder, or the old code of a module you edited, is never
  found), and after the run those plus every module imported from a path that was not on
  the rank's original ``sys.path`` are forgotten.  Bytecode is not written meanwhile
  (no ``__pycache__`` in your folders, no stale ``.pyc`` after an edit).
- **directory**: the script runs in the notebook kernel's current directory (as
  IPython's ``%run`` does; ``%cd`` is followed), as every cell does (:func:`follow_cwd`,
  called by :mod:`mnb.worker.main` for both); a ``chdir`` of the script's is undone after it.
- **environment**: the notebook's ``os.environ`` changes since the pool started
  (``%env``) are applied (:func:`apply_environ`; cells get them too, and keep them); what
  the script changes in ``os.environ`` is undone after it.
- **library singletons**: accelerate's ``PartialState``/``AcceleratorState``/
  ``GradientState`` start empty (Megatron's globals and RNG tracker: :mod:`mnb.megatron.adopt`);
  torch's default dtype and grad mode are restored after.
- **the process's own settings** (:class:`ProcessState`): warnings filters, the root logger's level
  and handlers, the recursion limit, ``sys.stdin``/``stdout``/``stderr`` and the display and except
  hooks, signal handlers (a script ignoring SIGINT made Kernel -> Interrupt restart the pool), the
  umask, ``random``'s and numpy's global generators, torch's deterministic-algorithms switch, and
  functions of ``torch``, ``torch.distributed``, ``torch.nn.functional`` and ``torch.cuda`` that the
  script replaced are put back after it; one line names what was.  Threads the script started keep
  running (a process cannot take them back).
- **mnb's names** (``rank``, ``device``, ``dist``, ``ps``, ``mnb``, ``torch``, ...) are
  mnb's again after the script; a script value that differed is named in one line.
"""

from __future__ import annotations

import importlib
import logging
import os
import random
import signal
import sys
import threading
import warnings
from typing import Any

from mnb.values import MNB_NAMES  # defined beside the push that refuses them; this import path kept
from mnb.worker.channel import NUDGE_SIGNAL

ORIGINAL_SYS_PATH = tuple(os.path.realpath(p or os.curdir) for p in sys.path)
"""The rank's ``sys.path`` when the worker started (imported by mnb.worker.main at start-up)."""

PROTECTED_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "MPLBACKEND",
    "PYTHONUNBUFFERED",
})
"""Variables the launcher and torchrun set per rank: the notebook's values never replace them."""


def _protected(key: str) -> bool:
    return key in PROTECTED_ENV or key.startswith(("TORCHELASTIC_", "MNB_"))


def apply_environ(changes: dict[str, Any] | None) -> None:
    """Apply the notebook kernel's ``os.environ`` changes since the pool started:
    ``{"set": {name: value}, "unset": [name, ...]}`` (torchrun's and mnb's own variables excepted)."""
    if not changes:
        return
    for key, value in (changes.get("set") or {}).items():
        if not _protected(key):
            os.environ[key] = str(value)
    for key in changes.get("unset") or ():
        if not _protected(key):
            os.environ.pop(key, None)


def follow_cwd(cwd: str) -> bool:
    """Go to the notebook kernel's directory ``cwd`` (every cell and script does, first); False when
    this host has no such folder, and the rank stays where it is (``mnb.worker.main`` says so once)."""
    try:
        os.chdir(cwd)
    except OSError:  # another host of the pool without that folder, or one it may not enter
        return False
    return True


def _module_folder(module: Any) -> str | None:
    """The folder a module was loaded from, as its ``__file__`` (or package path) says."""
    path = getattr(module, "__file__", None)
    if not path:
        paths = getattr(module, "__path__", None)
        try:
            path = next(iter(paths), None) if paths else None
        except TypeError:
            return None
        if not path:
            return None
        path = os.path.join(path, "__init__")
    return os.path.dirname(path) if isinstance(path, str) else None


def _under(folder: str, root: str) -> bool:
    return folder == root or folder.startswith(root.rstrip(os.sep) + os.sep)


def forget_modules(script_dir: str, before: set[str] | None = None) -> list[str]:
    """Forget modules from ``script_dir`` and (those not in ``before``) from paths outside the
    rank's original ``sys.path``; return their names.

    String comparisons for the thousands of modules a rank holds (a run must not spend a
    fraction of a second per rank on ``realpath``: ranks that start the script at different
    moments print lines that no longer fold); ``realpath`` only for the modules new in the run.
    """
    dirs = {os.path.abspath(script_dir), os.path.realpath(script_dir)}
    gone = []
    for name, module in list(sys.modules.items()):
        if name == "__main__" or module is None:
            continue
        folder = _module_folder(module)
        if folder is None:
            continue
        forget = any(_under(folder, d) for d in dirs)
        if not forget and before is not None and name not in before:
            real = os.path.realpath(folder)
            forget = _under(real, os.path.realpath(script_dir)) or not any(
                _under(real, root) for root in ORIGINAL_SYS_PATH)
        if forget:
            del sys.modules[name]
            gone.append(name)
    return gone


PATCHABLE_MODULES = ("torch", "torch.distributed", "torch.nn.functional", "torch.cuda")
"""Modules whose functions a script may replace (a tracing or monkeypatching script): put back after it."""
SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM")
                if hasattr(signal, name)) + (NUDGE_SIGNAL,)
"""The handlers a script may replace; NUDGE_SIGNAL's too, which the rank's interrupts rely on."""


class ProcessState:
    """What a script can change in the rank's process beyond its own names (module doc): taken before the
    script, :meth:`restore` puts it back and says what differed."""

    def __init__(self) -> None:
        import torch

        self.filters = list(warnings.filters)
        self.logging = (logging.root.level, list(logging.root.handlers), logging.root.manager.disable)
        self.recursion = sys.getrecursionlimit()
        self.streams = (sys.stdin, sys.stdout, sys.stderr, sys.displayhook, sys.excepthook)
        main = threading.current_thread() is threading.main_thread()
        self.signals = {s: signal.getsignal(s) for s in SIGNALS} if main else {}
        self.umask = os.umask(0)
        os.umask(self.umask)
        self.random = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())
        self.functions = {name: {k: v for k, v in vars(sys.modules[name]).items() if callable(v)}
                          for name in PATCHABLE_MODULES if name in sys.modules}

    def restore(self) -> list[str]:
        """Put everything back; the names of what the script had changed."""
        import torch

        changed = []
        if warnings.filters != self.filters:
            warnings.filters[:] = self.filters
            getattr(warnings, "_filters_mutated", lambda: None)()
            changed.append("warnings filters")
        root = logging.root
        if (root.level, root.handlers, root.manager.disable) != self.logging:
            root.setLevel(self.logging[0])
            root.handlers[:] = self.logging[1]
            logging.disable(self.logging[2])
            changed.append("the root logger")
        if sys.getrecursionlimit() != self.recursion:
            sys.setrecursionlimit(self.recursion)
            changed.append("the recursion limit")
        now = (sys.stdin, sys.stdout, sys.stderr, sys.displayhook, sys.excepthook)
        for name, mine, theirs in zip(("sys.stdin", "sys.stdout", "sys.stderr", "sys.displayhook", "sys.excepthook"),
                                      self.streams, now):
            if theirs is not mine:
                setattr(sys, name.split(".")[1], mine)
                changed.append(name)
        for sig, handler in self.signals.items():
            if signal.getsignal(sig) != handler and handler is not None:
                signal.signal(sig, handler)
                changed.append(f"the {signal.Signals(sig).name} handler")
        if os.umask(self.umask) != self.umask:
            changed.append("the umask")
        random.setstate(self.random)  # not named: a script seeding its own run is what scripts do
        numpy = sys.modules.get("numpy")
        if self.numpy is not None and numpy is not None:
            numpy.random.set_state(self.numpy)
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) \
                != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
            changed.append("torch.use_deterministic_algorithms")
        for name, functions in self.functions.items():
            module = sys.modules.get(name)
            for key, value in functions.items():
                if module is not None and vars(module).get(key) is not value:
                    setattr(module, key, value)
                    changed.append(f"{name}.{key}")
        return changed


def _reset_accelerate() -> None:
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    state.AcceleratorState._reset_state(reset_partial_state=True)
    state.GradientState._reset_state()


class ScriptSandbox:
    """The fresh-process state of one ``%mnb run`` (module doc); a context manager."""

    def __init__(self, path: str, namespace: dict[str, Any], kernel: dict[str, Any] | None) -> None:
        self.script_dir = os.path.dirname(path)
        self.namespace = namespace
        self.kernel = kernel or {}

    def __enter__(self) -> "ScriptSandbox":
        import torch

        forget_modules(self.script_dir)
        importlib.invalidate_caches()  # files added to the folders since the last import are found
        self._modules = set(sys.modules)
        self._bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
        self._cwd = os.getcwd()  # the kernel's, where this host has it (follow_cwd, before the script)
        self._environ = dict(os.environ)
        apply_environ(self.kernel.get("environ"))
        self._names = {k: self.namespace[k] for k in MNB_NAMES if k in self.namespace}
        self._torch_state = (torch.get_default_dtype(), torch.is_grad_enabled())
        self._process = ProcessState()
        self.restored: list[str] = []
        _reset_accelerate()
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch

        forget_modules(self.script_dir, self._modules)
        sys.dont_write_bytecode = self._bytecode
        os.chdir(self._cwd)
        os.environ.clear()
        os.environ.update(self._environ)
        torch.set_default_dtype(self._torch_state[0])
        torch.set_grad_enabled(self._torch_state[1])
        self.restored = self._process.restore()

    def restored_line(self) -> str | None:
        """The line naming the process settings the script changed and the sandbox put back (None: none)."""
        if not self.restored:
            return None
        shown = ", ".join(self.restored[:8]) + (f" and {len(self.restored) - 8} more" if len(self.restored) > 8 else "")
        return f"mnb: put back after the script, as a fresh process would have them: {shown}"

    def restore_names(self) -> str | None:
        """mnb's names again after the script's globals joined the namespace; the line saying
        which of the script's values differed (None when none did)."""
        differed = []
        for name, value in getattr(self, "_names", {}).items():  # {} if __enter__ failed early
            theirs = self.namespace.get(name, value)
            if theirs is not value and not _same(theirs, value):
                differed.append(f"{name} (the script's: {_short(theirs)})")
            self.namespace[name] = value
        if not differed:
            return None
        return "mnb: mnb's names are mnb's again after the script: " + ", ".join(differed)


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # an object whose == is not a bool (a tensor): not the same
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
