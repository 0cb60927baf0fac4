"""The GPU idioms of torchrun scripts, on CPU ranks: what runs on the CPU while a script runs.

:mod:`mnb.megatron.cpu` redirects Megatron's own CUDA calls for the life of a CPU rank.
A script written for ``torchrun`` on GPUs (the DDP tutorials' trainers, nanoGPT-style
trainers, library test scripts) asks for the GPU in more ways, and from modules it
imports as well as from its own lines.  :class:`ScriptRedirection` redirects those
**while the script runs**, in every module of the process, and only where the process
is a CPU rank (``%mnb run`` on a ``--device cpu`` pool, or a fresh process started by
``python -m mnb.megatron.cpurun``): on a CPU rank no CUDA call can succeed, so each one
mapped to the CPU turns a failure into the CPU's answer and nothing that worked changes.

Adopted (each named in the one line the run prints, when it was used):

- devices: ``.to(local_rank)``, ``.to("cuda:1")``, ``.to(torch.device("cuda", i))`` of
  tensors and modules, ``.cuda()``, ``device="cuda..."`` in tensor factories,
  ``tensor.pin_memory()`` (returns the tensor), ``torch.load(map_location="cuda:0" |
  {"cuda:1": "cuda:0"} | callable)`` (CUDA maps to the CPU; ``storage.cuda()`` inside a
  callable returns the storage; no map_location loads GPU checkpoints to the CPU),
  ``DistributedDataParallel(module, device_ids=[i], output_device=i)`` (dropped for a
  CPU module, as torch requires), ``torch.device("cuda:i")`` in the script itself.
- ``torch.cuda``: ``is_available()`` True and ``device_count()`` = ``LOCAL_WORLD_SIZE``
  *for the script's code* (its own file and files outside the installed packages; the
  libraries it calls -- accelerate, transformers, torch itself -- keep the honest CPU
  answers, False and 0, so they choose their CPU paths); ``current_device()`` =
  ``LOCAL_RANK``; ``set_device``, ``synchronize``, ``empty_cache`` do nothing;
  ``Event(enable_timing=True)`` times with the host clock (``elapsed_time`` in ms);
  ``current_stream()``/``default_stream()`` are inert (``.synchronize()`` returns at once);
  ``get_device_name``, ``is_bf16_supported``, ``memory_allocated`` & co. answer for the CPU;
  ``manual_seed(_all)`` stay torch's own (no CUDA generator to seed).
- mixed precision: ``torch.autocast(device_type="cuda", ...)``, ``torch.amp.autocast``,
  ``torch.cuda.amp.autocast`` run CPU autocast with the same dtype; ``torch.cuda.amp.
  GradScaler`` and ``torch.amp.GradScaler("cuda")`` are CPU grad scalers.

Not honoured, with an error naming it: ``torch.cuda.Stream()`` (stream semantics),
other ``torch.cuda`` calls that need a device (e.g. ``get_device_properties``, CUDA
kernels); torch's own message for NCCL-only collectives options.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import time
import types
from typing import Any, Callable

import torch

from mnb.errors import CudaStreamError
from mnb.megatron import cpu

_LIBRARY_ROOTS = tuple(sorted({os.path.realpath(p) + os.sep for p in (
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
    os.path.dirname(os.path.dirname(torch.__file__)), os.path.dirname(os.path.dirname(cpu.__file__)),
) if p}))
"""Code under these folders is a library's (or mnb's): it keeps the CPU's honest answers."""


def _is_device_like(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


def _user_caller(depth: int = 2) -> bool:
    """True when the function ``depth`` frames up was called from the script's own code."""
    return _is_user_file(sys._getframe(depth).f_code.co_filename)


@functools.lru_cache(maxsize=4096)
def _is_user_file(filename: str) -> bool:
    return not filename.startswith("<frozen") and not os.path.realpath(filename).startswith(_LIBRARY_ROOTS)


class _TimingEvent:
    """``torch.cuda.Event`` on a CPU rank: records the host clock (CPU work is synchronous)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None: ...
    def wait(self, stream: Any = None) -> None: ...

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "_TimingEvent") -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("torch.cuda.Event.elapsed_time: record() both events first")
        return (end._t - self._t) * 1000.0


def _no_stream(*args: Any, **kwargs: Any):
    raise CudaStreamError("torch.cuda.Stream: CUDA streams (their ordering and overlap) have no CPU "
                          "equivalent on mnb's CPU ranks; run this script on a GPU pool (%mnb start --device cuda)")


class _Autocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast("cuda", dtype)`` as CPU autocast with the same dtype."""

    def __init__(self, device_type: str = "cuda", dtype: Any = None, enabled: bool = True,
                 cache_enabled: bool | None = None) -> None:
        if isinstance(device_type, str) and device_type.startswith("cuda"):
            cpu.note("autocast(cuda)")
            device_type = "cpu"
            dtype = torch.bfloat16 if dtype is None else dtype  # CUDA's default is float16; CPU's bfloat16
        super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


def _cuda_amp_autocast(enabled: bool = True, dtype: Any = torch.float16, cache_enabled: bool = True):
    cpu.note("torch.cuda.amp.autocast")
    return torch.amp.autocast_mode.autocast("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


class _GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler("cuda")`` / ``torch.cuda.amp.GradScaler()`` as a CPU grad scaler."""

    def __init__(self, device: str = "cuda", *args: Any, **kwargs: Any) -> None:
        if not isinstance(device, str):  # torch.cuda.amp.GradScaler(init_scale, ...) has no device
            args, device = (device, *args), "cuda"
        if device.startswith("cuda"):
            cpu.note("GradScaler(cuda)")
            device = "cpu"
        super().__init__(device, *args, **kwargs)


class ScriptRedirection:
    """While the block runs, the process's GPU idioms run on the CPU (module doc).  Re-entrant
    use is not supported; the originals are back after the block, however it ends."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    # ---------------------------------------------------------------- patching
    def _set(self, owner: Any, name: str, value: Any) -> None:
        old = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        setattr(owner, name, value)

        def undo() -> None:
            if old is _MISSING:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
            else:
                setattr(owner, name, old)

        self._undo.append(undo)

    def __enter__(self) -> "ScriptRedirection":
        cpu.take_notes()
        try:
            self._install()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _install(self) -> None:
        T, M = torch.Tensor, torch.nn.Module
        self._set(T, "to", _mapped_to(T.to, "tensor.to(cuda)"))
        self._set(M, "to", _mapped_to(M.to, "module.to(cuda)"))
        self._set(T, "cuda", _returns_self("tensor.cuda()"))
        self._set(M, "cuda", _returns_self("module.cuda()"))
        self._set(T, "pin_memory", _returns_self("pin_memory()"))
        self._set(torch.UntypedStorage, "cuda", _returns_self("storage.cuda()"))
        for name in cpu.FACTORIES:
            self._set(torch, name, _mapped_factory(getattr(torch, name)))
        self._set(torch, "load", _mapped_load(torch.load))
        self._set(torch, "autocast", _Autocast)
        self._set(torch.amp, "autocast", _Autocast)
        self._set(torch.amp, "GradScaler", _GradScaler)
        self._set(torch.cuda.amp, "autocast", _cuda_amp_autocast)
        self._set(torch.cuda.amp, "GradScaler", _GradScaler)
        ddp = torch.nn.parallel.DistributedDataParallel
        self._set(ddp, "__init__", _ddp_init(ddp.__init__))
        for name, value in _cuda_answers().items():
            self._set(torch.cuda, name, value)
        self._when_imported("accelerate.state", self._accelerate_on_cpu)

    def _when_imported(self, name: str, patch: Callable[[types.ModuleType], None]) -> None:
        """``patch(module)`` now if ``name`` is imported, else right after the script imports it."""
        if name in sys.modules:
            patch(sys.modules[name])
            return
        hook = _AfterImport(name, patch)
        sys.meta_path.insert(0, hook)
        self._undo.append(lambda: hook in sys.meta_path and sys.meta_path.remove(hook))

    def _accelerate_on_cpu(self, state: types.ModuleType) -> None:
        """accelerate's ``PartialState()`` on a CPU rank of a torchrun world: ``cpu=True`` (MULTI_CPU on
        gloo, as ``accelerate launch --cpu`` gives), where it would otherwise find no GPU and run the
        script as one process of one (``DistributedType.NO``)."""
        original = state.PartialState.__init__

        def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
            if not cpu and not self._shared_state:
                _note_accelerate()
            original(self, True, **kwargs)

        self._set(state.PartialState, "__init__", __init__)


_MISSING = object()


def _note_accelerate() -> None:
    cpu.note("accelerate PartialState(cpu=True)")


class _AfterImport:
    """A ``sys.meta_path`` finder that patches one module right after it is executed."""

    def __init__(self, name: str, patch: Callable[[types.ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        if fullname != self.name:
            return None
        import importlib.abc
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, patch = spec.loader, self.patch

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = _Loader()
        return spec


def _mapped_to(original: Callable, idiom: str) -> Callable:
    def to(self, *args: Any, **kwargs: Any):
        if args and _is_device_like(args[0]):
            cpu.note(idiom)
            args = ("cpu", *args[1:])
        if _is_device_like(kwargs.get("device")):
            cpu.note(idiom)
            kwargs["device"] = "cpu"
        return original(self, *args, **kwargs)

    to.__doc__ = original.__doc__
    return to


def _returns_self(idiom: str) -> Callable:
    def same(self, *args: Any, **kwargs: Any):
        cpu.note(idiom)
        return self

    return same


def _mapped_factory(original: Callable) -> Callable:
    def factory(*args: Any, **kwargs: Any):
        if _is_device_like(kwargs.get("device")):
            cpu.note("device='cuda' in factories")
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return original(*args, **kwargs)

    factory.__name__ = getattr(original, "__name__", "factory")
    factory.__doc__ = original.__doc__
    return factory


def _cpu_location(location: Any) -> Any:
    if _is_device_like(location):
        cpu.note("torch.load(map_location=cuda)")
        return "cpu"
    if isinstance(location, dict):
        return {k: _cpu_location(v) for k, v in location.items()}
    return location


def _mapped_load(original: Callable) -> Callable:
    def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any):
        if map_location is None:
            map_location = "cpu"  # a checkpoint saved on GPUs loads on the CPU, as under --device cpu
        elif callable(map_location):
            chosen = map_location

            def map_location(storage, location, _chosen=chosen):  # noqa: E306 - the caller's choice, on the CPU
                result = _chosen(storage, location)
                return _cpu_location(result) if isinstance(result, (str, int, torch.device)) else result
        else:
            map_location = _cpu_location(map_location)
        return original(f, map_location, *args, **kwargs)

    load.__doc__ = original.__doc__
    return load


def _ddp_init(original: Callable) -> Callable:
    def __init__(self, module, device_ids=None, output_device=None, *args: Any, **kwargs: Any):
        on_cpu = all(p.device.type == "cpu" for p in module.parameters())
        if on_cpu and (device_ids is not None or output_device is not None):
            cpu.note("DDP(device_ids)")
            device_ids = output_device = None
        original(self, module, device_ids, output_device, *args, **kwargs)

    return __init__


def _cuda_answers() -> dict[str, Any]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    real_available, real_count = torch.cuda.is_available, torch.cuda.device_count

    def is_available() -> bool:
        if _user_caller():
            cpu.note("torch.cuda.is_available")
            return True
        return real_available()

    def device_count() -> int:
        if _user_caller():
            cpu.note("torch.cuda.device_count")
            return local_world
        return real_count()

    def noting(idiom: str, value: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any):
            if _user_caller():  # torch.manual_seed calls torch.cuda.manual_seed_all itself: not the script's
                cpu.note(idiom)
            return value(*args, **kwargs)

        return call

    return {
        "is_available": is_available,
        "device_count": device_count,
        "current_device": noting("torch.cuda.current_device", lambda: local_rank),
        "set_device": noting("torch.cuda.set_device", lambda device: None),
        "synchronize": noting("torch.cuda.synchronize", lambda device=None: None),
        "empty_cache": noting("torch.cuda.empty_cache", lambda: None),
        "Event": noting("torch.cuda.Event", _TimingEvent),
        "Stream": _no_stream,
        "current_stream": noting("torch.cuda.current_stream", lambda device=None: cpu._Inert()),
        "default_stream": noting("torch.cuda.default_stream", lambda device=None: cpu._Inert()),
        "get_device_name": noting("torch.cuda.get_device_name", lambda device=None: "CPU (mnb CPU rank)"),
        "is_bf16_supported": noting("torch.cuda.is_bf16_supported", lambda including_emulation=True: True),
        "memory_allocated": noting("torch.cuda.memory_allocated", lambda device=None: 0),
        "max_memory_allocated": noting("torch.cuda.max_memory_allocated", lambda device=None: 0),
        "memory_reserved": noting("torch.cuda.memory_reserved", lambda device=None: 0),
        "max_memory_reserved": noting("torch.cuda.max_memory_reserved", lambda device=None: 0),
        "reset_peak_memory_stats": noting("torch.cuda.reset_peak_memory_stats", lambda device=None: None),
        "manual_seed": noting("torch.cuda.manual_seed", torch.cuda.manual_seed),
        "manual_seed_all": noting("torch.cuda.manual_seed_all", torch.cuda.manual_seed_all),
    }


def summary_line(notes: list[str]) -> str | None:
    """The one line a run prints: which GPU calls ran on the CPU (None when none did)."""
    if not notes:
        return None
    return "mnb: GPU calls that ran on the CPU: " + ", ".join(notes)
