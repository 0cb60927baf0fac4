"""Run a GPU torchrun script in fresh CPU processes, under the same redirection as ``%mnb run``.

    torchrun --nproc-per-node 2 -m mnb.megatron.cpurun train.py --lr 3e-4

is what ``torchrun --nproc-per-node 2 train.py --lr 3e-4`` would do on two GPUs, on
two CPU processes instead: Megatron's CPU mode (:func:`mnb.megatron.cpu.install`),
the GPU idioms of :mod:`mnb.megatron.gpu_idioms`, ``init_process_group``/``new_group``
with ``backend="nccl"`` on gloo (``device_id`` dropped), and the script's own
``torch.device("cuda", i)`` the CPU device.  It is the fresh-process reference that a
``%mnb run`` of the same script on a CPU pool is compared with (same losses), and a
way to try a GPU script on a laptop without a pool.
"""

from __future__ import annotations

import builtins
import os
import sys
import tokenize
import types
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def script_builtins() -> dict[str, Any]:
    """The builtins of a script's own lines on a CPU rank: ``import torch`` binds
    :func:`mnb.megatron.cpu.script_torch` (attributes fall through to the real torch)."""
    from mnb.megatron import cpu

    view = cpu.script_torch()
    real_import = builtins.__import__

    def script_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        if level == 0 and (name == "torch" or name.startswith("torch.") and not fromlist):
            return view  # `import torch`, `import torch.nn as nn` (attributes fall through to torch)
        return module

    table = dict(vars(builtins))
    table["__import__"] = script_import
    return table


def script_module(path: str) -> tuple[types.ModuleType, types.CodeType]:
    """``__main__`` for the script at ``path`` and its compiled code (raises SyntaxError, OSError)."""
    with tokenize.open(path) as f:  # honours an encoding declaration, as python does
        code = compile(f.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __spec__=None, __package__=None)
    return module, code


def _gloo_for_nccl(backend: Any) -> Any:
    if backend is not None and "nccl" in str(backend).lower():
        return "gloo"
    return backend


def _adopt_nccl() -> None:
    """A fresh CPU process: the script's nccl groups run on gloo."""
    init, new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend: Any = None, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("device_id", None)
        return init(_gloo_for_nccl(backend) or "gloo", *args, **kwargs)

    def new_group_on_cpu(*args: Any, **kwargs: Any):
        if "backend" in kwargs:
            kwargs["backend"] = _gloo_for_nccl(kwargs["backend"])
        return new_group(*args, **kwargs)

    for module in (dist, c10d):
        module.init_process_group = init_process_group
        module.new_group = new_group_on_cpu


class _CpuModeOnMegatronImport:
    """Install Megatron's CPU mode once ``megatron.core`` is imported (scripts without Megatron
    skip its seconds of import, as a fresh process would)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname != "megatron.core":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        from mnb.megatron import cpu

        return cpu.after_exec(importlib.util.find_spec(fullname), _install_cpu_mode)


def _install_cpu_mode(module: Any) -> None:
    """Megatron's CPU mode, keeping the script's own ``.cuda()`` redirection (gpu_idioms)."""
    import torch

    from mnb.megatron import cpu

    script_cuda = torch.Tensor.cuda, torch.nn.Module.cuda
    cpu.install()
    torch.Tensor.cuda, torch.nn.Module.cuda = script_cuda


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if argv else 2)
    path = os.path.abspath(argv[0])
    if not os.path.isfile(path):
        sys.exit(f"mnb.megatron.cpurun: no script {path}")
    from mnb.megatron import cpu, gpu_idioms

    if "megatron.core" in sys.modules:
        cpu.install()
    else:
        sys.meta_path.insert(0, _CpuModeOnMegatronImport())
    _adopt_nccl()
    module, code = script_module(path)
    module.__dict__["__builtins__"] = script_builtins()
    sys.argv = [path, *argv[1:]]
    sys.path[0] = os.path.dirname(path)
    sys.modules["__main__"] = module
    redirection = gpu_idioms.ScriptRedirection()
    try:
        with redirection:
            exec(code, module.__dict__)
    finally:
        line = gpu_idioms.summary_line(cpu.take_notes())
        if line and os.environ.get("RANK", "0") == "0":  # once per run
            print(line, flush=True)


if __name__ == "__main__":
    main()
