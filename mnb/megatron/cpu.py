"""CPU mode: run Megatron-Core's GPU code paths on CPU ranks (gloo).

Megatron-Core assumes CUDA in several places even when every tensor it is
given lives on the CPU.  :func:`install` redirects those calls, **only in the
rank process that calls it** (the worker calls it when the pool was started
with ``--device cpu``).  Nothing is changed on GPU ranks.

Checked at both ends of ``SUPPORTED``, the two legs of CI (``.ci/run``):
megatron-core 0.16.1 on Python 3.11 and 0.19.2 on Python 3.12 (0.19 needs
Python >= 3.12); 0.19's new CUDA call sites (``current_stream`` in grad sync,
...) go through the same proxy.  Outside ``SUPPORTED`` :func:`install` still
runs but warns, because new CUDA-only call sites may have appeared.  The redirections, and why each one
is needed:

1. **Megatron's own view of ``torch``** (one mechanism, most call sites).
   Every ``megatron.*`` module's global name ``torch`` is replaced by a thin
   proxy module: attribute access falls through to the real torch, except

   - ``torch.cuda`` -> :class:`_CudaShim`: ``current_device()`` returns
     ``torch.device("cpu")`` (tensor_parallel layers/mappings,
     ``GlobalMemoryBuffer``, p2p shape/recv buffers, ``param_and_grad_buffer``,
     RoPE ``inv_freq``, MoE router); ``synchronize``/``empty_cache`` are no-ops
     (p2p batch sync, timers, DDP, dist_checkpointing preload/save);
     streams and events are inert (0.19 grad sync, DDP overlap);
     ``is_available()`` is False; rng calls act on the CPU generator.
   - tensor factories (``torch.tensor/zeros/empty/ones/full/arange/...``) map
     ``device="cuda"`` to ``"cpu"`` and drop ``pin_memory``: literal
     ``device="cuda"`` in all three schedules (``total_num_tokens``), the
     FP32/mixed-precision optimizers, ``clip_grads``, the grad scaler,
     ``local_multi_tensor_l2_norm``, dist_checkpointing's verification.
   - ``torch.autocast("cuda", ...)`` becomes ``torch.autocast("cpu", ...)``
     (schedules.py, when ``config.enable_autocast``).
   - ``torch.device("cuda...")`` is the CPU device (Megatron-FSDP builds
     ``torch.device(f"cuda:{current_device()}")`` and asks groups for their CUDA backend).

   A module-level ``DeviceMesh`` (Megatron-FSDP's adapter builds its meshes with
   ``DeviceMesh.from_group(..., device_type="cuda")``, and DTensors on a CUDA mesh move
   their shards to CUDA) becomes one that makes ``cpu`` meshes.

   Modules imported later are patched by a ``sys.meta_path`` hook.
2. ``Tensor.cuda()`` and ``Module.cuda()`` called *from Megatron code* return
   the object itself (tied embeddings with pp > 1 in language_module.py,
   optimizer and grad scaler ``load_state_dict``, dist_checkpointing exchange
   utils, Megatron-LM's ``get_model``).  A script run by ``%mnb run`` gets more
   (every module, while it runs): :mod:`mnb.megatron.gpu_idioms`, :func:`script_torch`.
3. ``Tensor.type()`` called *from Megatron code* reports CPU tensors under
   their ``torch.cuda.*`` names: the optimizers (``Float16OptimizerWith
   Float16Params``, ``DistributedOptimizer``) and ``clip_grad_by_total_norm_
   fp32`` compare against ``'torch.cuda.FloatTensor'`` and raise otherwise.
4. ``tensor_parallel.random._get_cuda_rng_state``/``_set_cuda_rng_state``
   read/write the CPU generator, so activation recompute replays dropout.
   Layouts use Megatron's inference RNG tracker on CPU (``layout.py``), whose
   ``fork()`` is a no-op: all dropout draws from the CPU generator (tp ranks
   share the stream; mnb's dropout default is 0).
5. ``moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True)`` converts only CUDA
   tensors, so on CPU the alltoall token dispatcher (MoE with ep > 1) hands
   tensors, not int sequences, to ``all_to_all_single`` split sizes
   (TypeError).  The replacement also converts CPU tensors when asked for numpy
   (patched in ``moe_utils`` and ``token_dispatcher``, which imports it by name).

Tests: ``tests/megatron/test_cpu.py`` exercises each redirection.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import sys
import types
import warnings
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED = (">=0.16", "<0.20")
"""megatron-core versions this module is meant for (checked: 0.16.1 and 0.19.2, CI's two legs)."""

_REAL_TORCH = torch
_INSTALLED = False
_ORIG_TENSOR_CUDA = torch.Tensor.cuda
_ORIG_TENSOR_TYPE = torch.Tensor.type
_ORIG_MODULE_CUDA = torch.nn.Module.cuda
_NOTES: dict[str, None] = {}
"""GPU idioms a script used that ran on the CPU, in first-use order (:func:`note`)."""


def note(idiom: str) -> None:
    """Remember that ``idiom`` (a GPU call) ran on the CPU, for the line a script's run prints."""
    _NOTES.setdefault(idiom, None)


def take_notes() -> list[str]:
    """The idioms noted since the last call, in first-use order (and forget them)."""
    notes = list(_NOTES)
    _NOTES.clear()
    return notes


def installed() -> bool:
    """True once :func:`install` has run in this process."""
    return _INSTALLED


def _to_cpu_device(device: Any) -> Any:
    """Map any CUDA device spelling (str, int, torch.device) to 'cpu'."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def _factory(fn):
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__doc__ = f"CPU-mode wrapper of torch.{wrapper.__name__} (device='cuda' -> 'cpu')."
    return wrapper


FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "eye",
    "rand", "randn", "randint", "randperm", "empty_like", "zeros_like", "ones_like",
    "full_like", "empty_strided",
)


class _Inert:
    """A CUDA stream or event that does nothing (CPU ops are already ordered)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def wait_stream(self, *a: Any) -> None: ...
    def wait_event(self, *a: Any) -> None: ...
    def wait(self, *a: Any) -> None: ...
    def synchronize(self) -> None: ...
    def record(self, *a: Any) -> None: ...
    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> "_Inert":
        return event if event is not None else _Inert()

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _CudaShim(types.ModuleType):
    """What Megatron sees as ``torch.cuda`` on a CPU rank."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        nvtx = types.SimpleNamespace(
            range_push=lambda *a, **k: None,
            range_pop=lambda *a, **k: None,
            range=lambda *a, **k: contextlib.nullcontext(),
            mark=lambda *a, **k: None,
        )
        rng = types.SimpleNamespace(
            get_rng_state=lambda device=None: torch.get_rng_state(),
            set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        )
        self.__dict__.update(
            is_available=lambda: False,
            is_initialized=lambda: False,
            current_device=lambda: torch.device("cpu"),
            set_device=lambda device: None,  # torchrun scripts and Megatron-LM's initialize call it
            device_count=lambda: 0,
            synchronize=lambda *a, **k: None,
            empty_cache=lambda: None,
            current_stream=lambda *a, **k: _Inert(),
            default_stream=lambda *a, **k: _Inert(),
            Stream=_Inert,
            Event=_Inert,
            stream=lambda *a, **k: contextlib.nullcontext(),
            memory_allocated=lambda *a, **k: 0,
            max_memory_allocated=lambda *a, **k: 0,
            memory_reserved=lambda *a, **k: 0,
            max_memory_reserved=lambda *a, **k: 0,
            reset_peak_memory_stats=lambda *a, **k: None,
            reset_max_memory_allocated=lambda *a, **k: None,
            nvtx=nvtx,
            random=rng,
            get_rng_state=rng.get_rng_state,
            set_rng_state=rng.set_rng_state,
            manual_seed=lambda seed: torch.manual_seed(seed),
            manual_seed_all=lambda seed: torch.manual_seed(seed),
        )

    def __getattr__(self, name: str) -> Any:  # anything else: the real torch.cuda
        return getattr(_REAL_TORCH.cuda, name)


class _CpuDevice(type):
    """``torch.device`` as code on a CPU rank sees it: CUDA spellings make the CPU device.

    Two views use it: Megatron's (Megatron-FSDP compares its device against
    ``torch.device(f"cuda:{current_device()}")`` and asks process groups for their backend by
    ``torch.device("cuda", current_device())``) and a torchrun script's, which also notes the
    redirection for the run's one-line summary (the class's ``noted`` text).
    """

    def __call__(cls, *args: Any, **kwargs: Any):
        if args and isinstance(args[0], str) and args[0].startswith("cuda") or \
                str(kwargs.get("type", "")).startswith("cuda"):
            if getattr(cls, "noted", None):
                note(cls.noted)
            return _REAL_TORCH.device("cpu")
        return _REAL_TORCH.device(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _REAL_TORCH.device)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return issubclass(sub, _REAL_TORCH.device)


class _MeshType(type):
    """``DeviceMesh`` as Megatron code sees it on a CPU rank: meshes of device type ``cpu``.

    Megatron-FSDP's adapter builds its meshes with ``DeviceMesh.from_group(...,
    device_type="cuda")``; DTensors on such a mesh move their local shards to CUDA.
    """

    def __call__(cls, device_type: str, *args: Any, **kwargs: Any):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(_mesh_device(device_type), *args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        from torch.distributed.device_mesh import DeviceMesh

        return isinstance(obj, DeviceMesh)

    def __getattr__(cls, name: str) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        return getattr(DeviceMesh, name)


def _mesh_device(device_type: Any) -> Any:
    return "cpu" if isinstance(device_type, str) and device_type.startswith("cuda") else device_type


class _CpuDeviceMesh(metaclass=_MeshType):
    @staticmethod
    def from_group(group: Any, device_type: str, *args: Any, **kwargs: Any):
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(group, _mesh_device(device_type), *args, **kwargs)


def _autocast(device_type: str = "cpu", *args: Any, **kwargs: Any):
    if isinstance(device_type, str) and device_type.startswith("cuda"):
        device_type = "cpu"
    return _REAL_TORCH.autocast(device_type, *args, **kwargs)


def _make_torch_proxy() -> types.ModuleType:
    proxy = types.ModuleType("torch", "Megatron's view of torch on a CPU rank (mnb.megatron.cpu).")
    overrides: dict[str, Any] = {name: _factory(getattr(torch, name)) for name in FACTORIES}
    overrides["cuda"] = _CudaShim()
    overrides["autocast"] = _autocast
    overrides["device"] = _CpuDevice("device", (), {"__doc__": "Megatron's torch.device on a CPU rank"})
    proxy.__dict__.update(overrides)
    proxy.__dict__["__getattr__"] = lambda name: getattr(_REAL_TORCH, name)
    proxy.__dict__["__mnb_cpu_proxy__"] = True
    return proxy


_PROXY = _make_torch_proxy()


def _is_megatron(module_name: str) -> bool:
    return module_name == "megatron" or module_name.startswith(("megatron.", "megatron_fsdp"))


def _patch_module(module: types.ModuleType) -> None:
    if getattr(module, "torch", None) is _REAL_TORCH:
        module.torch = _PROXY
    mesh = module.__dict__.get("DeviceMesh")
    if mesh is not None and mesh is _real_device_mesh():
        module.DeviceMesh = _CpuDeviceMesh


class _MegatronImportHook(importlib.abc.MetaPathFinder):
    """Patch Megatron modules imported after install() as they finish loading."""

    def find_spec(self, fullname, path, target=None):
        if not _is_megatron(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        return after_exec(spec, _patch_module)


def after_exec(spec, then):
    """``spec`` with its loader wrapped so that ``then(module)`` runs once the module has executed
    (a spec without an ``exec_module`` loader comes back as it is)."""
    loader = spec.loader if spec is not None else None
    if loader is None or not hasattr(loader, "exec_module"):
        return spec

    class _Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return loader.create_module(spec)

        def exec_module(self, module):
            loader.exec_module(module)
            then(module)

    spec.loader = _Loader()
    return spec


def _real_device_mesh() -> Any:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # torch without DTensor
        return None
    return DeviceMesh


def _caller_is_megatron(depth: int = 2) -> bool:
    frame = sys._getframe(depth)
    return _is_megatron(frame.f_globals.get("__name__", ""))


def script_torch() -> types.ModuleType:
    """The ``torch`` a torchrun script's own lines see on a CPU rank: the real torch (with the
    GPU idioms of :mod:`mnb.megatron.gpu_idioms` redirected while it runs), except that
    ``torch.device("cuda", i)`` gives the CPU device, so ``.to(device)`` and ``x.device == device``
    hold on the CPU."""
    view = types.ModuleType("torch", "A torchrun script's view of torch on a CPU rank (mnb.megatron.cpu).")
    view.__dict__["__getattr__"] = lambda name: getattr(_REAL_TORCH, name)
    view.__dict__["device"] = _CpuDevice("device", (), {"__doc__": "CPU-mode torch.device",
                                                        "noted": "torch.device('cuda')"})
    view.__dict__["__mnb_cpu_proxy__"] = True
    return view


def real_torch(value: Any) -> Any:
    """``value``, or the real torch where ``value`` is one of this module's views of it."""
    return _REAL_TORCH if getattr(value, "__mnb_cpu_proxy__", False) else value


def _tensor_cuda(self, *args: Any, **kwargs: Any):
    if _caller_is_megatron():
        return self
    return _ORIG_TENSOR_CUDA(self, *args, **kwargs)


def _module_cuda(self, device: Any = None):
    if _caller_is_megatron():  # Megatron-LM's get_model moves every chunk with .cuda()
        return self
    return _ORIG_MODULE_CUDA(self, device)


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs: Any):
    if dtype is None and not kwargs and _caller_is_megatron():
        name = _ORIG_TENSOR_TYPE(self)
        if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name
    if dtype is None:
        return _ORIG_TENSOR_TYPE(self)
    return _ORIG_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def version_supported(version: str) -> bool:
    """True for megatron-core versions whose CUDA call sites were checked (>=0.16,<0.20)."""
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return False
    return major == 0 and 16 <= minor < 20


def _check_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        import megatron.core

        found = getattr(megatron.core, "__version__", "unknown")
    if not version_supported(found):
        warnings.warn(
            f"mnb CPU mode was checked against megatron-core {','.join(SUPPORTED)}; found {found}. "
            "New CUDA-only call sites may fail on CPU ranks: use a GPU pool or a supported version.",
            stacklevel=3,
        )
    return found


def install() -> None:
    """Redirect Megatron-Core's hard-coded CUDA calls to the CPU (idempotent).

    Call once in a CPU rank process, before or after importing Megatron::

        from mnb.megatron import cpu
        cpu.install()
    """
    global _INSTALLED
    if _INSTALLED:
        # Re-sweep in case modules were imported by a path the hook missed.
        _sweep()
        return
    found = _check_version()
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    # Import the parts of Megatron that carry CUDA call sites, then patch them.
    import megatron.core.tensor_parallel.random as mrandom

    sys.meta_path.insert(0, _MegatronImportHook())
    _sweep()
    torch.Tensor.cuda = _tensor_cuda
    torch.Tensor.type = _tensor_type
    torch.nn.Module.cuda = _module_cuda
    mrandom._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(
        new_state
    )
    _patch_moe_splits()
    _INSTALLED = True
    logger.info("mnb CPU mode installed for megatron-core %s", found)


def _maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _patch_moe_splits() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    for module in (moe_utils, token_dispatcher):
        if hasattr(module, "maybe_move_tensor_to_cpu"):
            module.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu


def _sweep() -> None:
    for name, module in list(sys.modules.items()):
        if module is not None and _is_megatron(name):
            _patch_module(module)
