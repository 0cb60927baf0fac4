"""Which values can travel between the ranks and the notebook kernel, and how.

The notebook kernel never imports torch or Megatron, yet pickle stores
functions and classes by reference: unpickling ``torch.nn.functional.relu``
(or a model, or a class a cell defined) imports torch there, or fails.  So a
pulled value travels as bytes, one pickle per name, and the kernel opens it
with :func:`loads_safe`, an unpickler that rebuilds only plain data: builtin
types, ``collections``, ``datetime``, ``decimal``, ``fractions``, ``uuid``,
``pathlib``, compiled ``re`` patterns, numpy arrays, dtypes and scalars, and
:class:`Unportable`.

On the rank (``executor.portable`` and the ``pull`` handler)::

    kernel_safe(torch.ones(2, dtype=torch.bfloat16))   # array([1., 1.], dtype=float32)
    kernel_safe(torch.nn.functional.relu)    # <not portable: torch function relu (...): <function relu ...>>
    encode_values({"x": x, "f": f})                    # {"x": b"...", "f": b"..."}

In the kernel (``Pool.pull``)::

    decode_values(encoded)                             # {"x": ..., "f": Unportable(...)}

Towards the ranks, :func:`encode_push` pickles each pushed name in the kernel
and refuses, before anything is sent, what the ranks could not rebuild
(lambdas, functions and classes of the notebook, open files, locks) and mnb's
own names (:data:`MNB_NAMES`: ``rank``, ``dist``, ...).

Standard library only at module level: importable on both sides.
"""

from __future__ import annotations

import io
import pickle
import sys
import types
from dataclasses import dataclass
from typing import Any

from mnb.errors import PushRefused, ValueDecodeError
from mnb.units import format_mib

PROTOCOL = 5
MAX_DEPTH = 8
"""Containers deeper than this are checked as one value (and become Unportable if they hold tensors)."""
REPR_LIMIT = 4000
"""Characters of a value's repr kept in its Unportable note."""
MNB_NAMES = ("rank", "world_size", "local_rank", "device", "torch", "dist", "ps", "mnb", "display")
"""The names mnb binds in every rank's namespace (``mnb.worker.boot``): a push never rebinds them
(:func:`encode_push`), and ``%mnb run`` puts them back after a script (``mnb.worker.sandbox``)."""

# Packages whose objects never travel to the kernel: it does not import them
# (torch, Megatron, their kernels), or cannot (``__mnb__`` is the rank's cell namespace).
NEVER_IN_KERNEL = frozenset({"torch", "megatron", "transformer_engine", "apex", "triton", "mnb", "__mnb__"})

# Modules whose classes (and only classes) the kernel rebuilds.
_CLASS_MODULES = frozenset({"builtins", "collections", "datetime", "decimal", "fractions", "pathlib",
                            "pathlib._local", "uuid"})
_REFUSED_BUILTINS = frozenset({"type", "super", "classmethod", "staticmethod", "property", "memoryview"})
_BUILTIN_CONSTANTS = frozenset({"Ellipsis", "NotImplemented"})
# Functions the kernel may call while unpickling: reconstructors of the types above.
_SAFE_GLOBALS = frozenset({
    ("copyreg", "_reconstructor"),
    ("_codecs", "encode"),
    ("re", "_compile"),
    ("re", "RegexFlag"),
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.ma", "MaskedArray"),
    ("numpy.ma.core", "MaskedArray"),
    ("numpy.ma.core", "_mareconstruct"),
    ("mnb.values", "Unportable"),
    ("mnb.results", "TrainResult"),  # mnb.train's record and mnb.load's answer: dicts with a one-line repr
    ("mnb.results", "LoadResult"),
})
_KERNEL_MODULES = frozenset({__name__, "mnb.results"})
"""mnb's own modules whose objects the kernel rebuilds (stdlib-only, both sides)."""
_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType)


# -- the kernel's unpickler --------------------------------------------------------------


class NotKernelSafe(pickle.UnpicklingError):
    """A pickle names a global outside the kernel's list (unpickling it would import ``module``)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name
        loaded = module == "builtins" or module in _CLASS_MODULES
        super().__init__(f"{module}.{name} is not plain data the notebook kernel rebuilds"
                         + ("" if loaded else f" (unpickling it would import {module} there)"))

    def __reduce__(self):  # rebuilt from its fields, not from its message (pickle, copy.deepcopy)
        return type(self), (self.module, self.name), dict(self.__dict__)


class KernelUnpickler(pickle.Unpickler):
    """An Unpickler that resolves only the globals of plain data (see the module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        if module == "builtins" and name in _BUILTIN_CONSTANTS:
            return super().find_class(module, name)
        if module in _CLASS_MODULES and not name.startswith("_") and "." not in name:
            found = super().find_class(module, name)
            if isinstance(found, type) and not (module == "builtins" and name in _REFUSED_BUILTINS):
                return found
        raise NotKernelSafe(module, name)


def loads_safe(data: bytes) -> Any:
    """``pickle.loads`` that rebuilds plain data only; :class:`NotKernelSafe` for anything else."""
    return KernelUnpickler(io.BytesIO(data)).load()


# -- what stands in for a value that cannot travel ----------------------------------------


@dataclass(frozen=True)
class Unportable:
    """Stands in, in the kernel, for a rank value that cannot travel there.

    ``repr``: the value's repr on the rank (cut at REPR_LIMIT characters);
    ``reason``: what the value is and why it stayed on the rank.
    """

    repr: str
    reason: str

    def __repr__(self) -> str:
        return f"<not portable: {self.reason}: {self.repr}>"

    __str__ = __repr__


def too_large(value: Any, size_bytes: int, limit_bytes: int, rank: int) -> Unportable:
    """The note that stands in for a cell's value whose reply would pass the protocol's limit of one
    message (``mnb.protocol.MAX_MESSAGE_BYTES``): the value stays on ``rank``, the note says how to get at it."""
    return Unportable(_short_repr(value), (
        f"a value of {format_mib(size_bytes)}, over the {format_mib(limit_bytes)} limit of one message; it stays "
        f"on rank {rank}: bind it to a name in the cell and pull a part or a summary of it (pool.pull), or "
        "save it to a file"))


# -- rank side: make a value kernel-safe -----------------------------------------------------


def kernel_safe(value: Any) -> Any:
    """A copy of ``value`` that :func:`loads_safe` rebuilds in the kernel without torch.

    Tensors become numpy arrays (bf16/fp16/fp8 via float32); dicts, lists, tuples
    and sets are converted element by element (to plain dict/list/tuple/set, down
    to MAX_DEPTH levels); any other value is kept if it pickles and its pickle
    rebuilds with :func:`loads_safe`, else it becomes an :class:`Unportable` note.
    Never raises.
    """
    try:
        return _convert(value, 0)
    except Exception as exc:  # a container whose items() or __hash__ raises, a recursion error ...
        return Unportable(_short_repr(value),
                          f"{_describe(value)} could not be converted ({type(exc).__name__}: {exc})")


def _convert(value: Any, depth: int) -> Any:
    if type(value) in _ATOMS:
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _tensor_to_numpy(value, torch)
    if depth < MAX_DEPTH:
        if isinstance(value, dict):
            pairs = [(_convert_key(k, depth + 1), _convert(v, depth + 1)) for k, v in value.items()]
            same = all(k is k2 and v is v2 for (k, v), (k2, v2) in zip(value.items(), pairs))
            return _own_type_or(value, dict(pairs), same)
        if isinstance(value, (list, tuple)):
            items = [_convert(v, depth + 1) for v in value]
            plain = items if isinstance(value, list) else tuple(items)
            return _own_type_or(value, plain, all(a is b for a, b in zip(value, items)))
        if isinstance(value, (set, frozenset)):
            members = {id(v): _convert_key(v, depth + 1) for v in value}
            plain = set(members.values()) if isinstance(value, set) else frozenset(members.values())
            return _own_type_or(value, plain, all(members[id(v)] is v for v in value))
    return _checked(value)


def _own_type_or(value: Any, plain: Any, unchanged: bool) -> Any:
    """A container subclass (OrderedDict, Counter, a namedtuple ...) keeps its type when its
    contents needed no conversion and the type itself travels; else the plain container."""
    if type(value).__module__ in _KERNEL_MODULES and isinstance(value, dict):
        return type(value)(plain)  # mnb's own readable dicts (mnb.results) keep their type, converted inside
    if type(value) in (dict, list, tuple, set, frozenset) or not unchanged:
        return plain
    kept = _checked(value)
    return plain if isinstance(kept, Unportable) else kept


def _convert_key(key: Any, depth: int) -> Any:
    """A dict key or set member, converted; an Unportable note if it is no longer hashable."""
    converted = _convert(key, depth)
    try:
        hash(converted)
    except TypeError:
        return Unportable(_short_repr(key), f"{_describe(key)} (unhashable once converted, e.g. a tensor key)")
    return converted


def _tensor_to_numpy(value: Any, torch: Any) -> Any:
    try:
        tensor = value.detach().cpu().resolve_conj().resolve_neg()
        if tensor.dtype in (torch.bfloat16, torch.float16) or "float8" in str(tensor.dtype):
            tensor = tensor.float()
        return tensor.numpy()
    except Exception as exc:  # meta, sparse, quantized, complex32 ...: the note says which
        return Unportable(_short_repr(value),
                          f"torch tensor that does not convert to numpy ({type(exc).__name__}: {exc})")


def _checked(value: Any) -> Any:
    module = _home(value)
    if module is not None and module.split(".")[0] in NEVER_IN_KERNEL and module not in _KERNEL_MODULES:
        return Unportable(_short_repr(value), _refusal(value, module))
    numpy = sys.modules.get("numpy")
    if (numpy is not None and type(value) is numpy.ndarray
            and value.dtype.isbuiltin == 1 and not value.dtype.hasobject):
        return value  # the common large case (numpy's own dtypes): known to rebuild, no trial pickle
    try:
        data = pickle.dumps(value, protocol=PROTOCOL)
    except Exception as exc:
        return Unportable(_short_repr(value), f"{_describe(value)} cannot be pickled ({type(exc).__name__}: {exc})")
    try:
        loads_safe(data)
    except NotKernelSafe as exc:
        return Unportable(_short_repr(value), _refusal(value, exc.module, exc.name))
    except Exception as exc:
        return Unportable(_short_repr(value),
                          f"{_describe(value)} does not unpickle ({type(exc).__name__}: {exc})")
    return value


def _home(value: Any) -> str | None:
    """The module a value's pickle would name first: its own for functions and classes."""
    if isinstance(value, types.ModuleType):
        return value.__name__
    if isinstance(value, (type, *_FUNCTIONS)):
        module = getattr(value, "__module__", None)
        return module if isinstance(module, str) else None
    return type(value).__module__


def _describe(value: Any) -> str:
    """'torch function relu', 'class Foo', 'torch.nn.modules.linear.Linear object' ..."""
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, type):
        kind, obj = "class", value
    elif isinstance(value, _FUNCTIONS):
        kind, obj = "function", value
    else:
        cls = type(value)
        module = cls.__module__
        where = "" if module in ("builtins", "__mnb__") else f"{module}."
        return f"{where}{cls.__qualname__} object"
    module = getattr(obj, "__module__", None) or ""
    plain = isinstance(obj, types.BuiltinFunctionType)  # torch's qualnames: '_VariableFunctionsClass.add'
    name = (None if plain else getattr(obj, "__qualname__", None)) or getattr(obj, "__name__", "?")
    root = module.split(".")[0]
    return f"{kind} {name}" if root in ("", "builtins", "__mnb__") else f"{root} {kind} {name}"


def _refusal(value: Any, module: str, name: str = "") -> str:
    root = module.split(".")[0]
    if root == "__mnb__":
        why = ("defined in a %%megatron cell, which the notebook kernel cannot rebuild; "
               "pull plain data instead: numbers, str, lists, dicts, tensors")
    elif root == "mnb":
        why = f"{module} lives on the ranks, the notebook kernel does not rebuild its objects"
    elif root in NEVER_IN_KERNEL:
        why = f"the notebook kernel does not import {root}"
    else:
        why = f"the notebook kernel rebuilds plain data only, and this needs {module}.{name or '...'}"
    return f"{_describe(value)} ({why})"


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # a broken __repr__ must not break the pull
        text = f"<{type(value).__qualname__} object; repr failed: {type(exc).__name__}: {exc}>"
    if len(text) > REPR_LIMIT:
        text = text[:REPR_LIMIT] + f"... ({len(text) - REPR_LIMIT} more characters)"
    return text


# -- both directions: one pickle per name ---------------------------------------------------


def encode_values(values: dict[str, Any]) -> dict[str, bytes]:
    """Rank side of a pull: each name's :func:`kernel_safe` value, pickled on its own. Never raises."""
    encoded = {}
    for name, value in values.items():
        safe = kernel_safe(value)
        try:
            encoded[name] = pickle.dumps(safe, protocol=PROTOCOL)
        except Exception as exc:  # kernel_safe checked it; a value whose pickling is not repeatable
            note = Unportable(_short_repr(value), f"{_describe(value)} cannot be pickled ({type(exc).__name__}: {exc})")
            encoded[name] = pickle.dumps(note, protocol=PROTOCOL)
    return encoded





def decode_values(encoded: dict[str, bytes]) -> dict[str, Any]:
    """Kernel side of a pull: {name: value}; :class:`ValueDecodeError` names every name that failed."""
    decoded: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for name, data in encoded.items():
        if not isinstance(data, (bytes, bytearray)):
            problems[name] = f"arrived as {type(data).__name__}, not as an encoded value"
            continue
        try:
            decoded[name] = loads_safe(data)
        except NotKernelSafe as exc:
            problems[name] = str(exc)
        except Exception as exc:
            problems[name] = f"{type(exc).__name__}: {exc}"
    if problems:
        raise ValueDecodeError(problems, decoded)
    return decoded


class _ToRanksPickler(pickle.Pickler):
    """Refuses functions and classes of the notebook's ``__main__``: the ranks do not have them."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, (type, types.FunctionType)) and getattr(obj, "__module__", None) == "__main__":
            kind = "class" if isinstance(obj, type) else "function"
            raise pickle.PicklingError(f"{kind} {obj.__qualname__} is defined in the notebook, "
                                       "whose namespace the ranks do not share")
        return NotImplemented


def encode_push(namespace: dict[str, Any]) -> dict[str, bytes]:
    """Kernel side of a push: {name: pickle}; TypeError naming every name the ranks could not rebuild.

    Raises before anything is sent, so a refused push changes nothing.
    """
    if not isinstance(namespace, dict):
        raise TypeError(f"push takes a dict of {{name: value}}, got {type(namespace).__name__}")
    bad_names = [name for name in namespace if not (isinstance(name, str) and name.isidentifier())]
    if bad_names:
        raise ValueError(f"push binds Python names; these are not identifiers: {bad_names!r}")
    own = [name for name in namespace if name in MNB_NAMES]
    if own:
        raise ValueError(f"push would rebind mnb's own name(s) {own!r} on the ranks (nothing was sent): every "
                         f"cell relies on {', '.join(MNB_NAMES)}; push the value under another name, e.g. "
                         f"{{'{own[0]}_value': ...}}")
    encoded: dict[str, bytes] = {}
    problems: dict[str, str] = {}
    for name, value in namespace.items():
        buffer = io.BytesIO()
        try:
            _ToRanksPickler(buffer, protocol=PROTOCOL).dump(value)
        except Exception as exc:
            problems[name] = _push_problem(value, exc)
            continue
        encoded[name] = buffer.getvalue()
    if problems:
        raise PushRefused(
            f"cannot push {', '.join(map(repr, problems))} to the ranks (nothing was sent):\n"
            + "".join(f"  {name}: {why}\n" for name, why in problems.items())
            + "Define functions, classes, open files and locks in a %%megatron cell instead; "
            "push plain data (numbers, str, lists, dicts, numpy arrays)."
        )
    return encoded


def _push_problem(value: Any, exc: Exception) -> str:
    detail = f"{type(exc).__name__}: {exc}"
    name = getattr(value, "__qualname__", "") if isinstance(value, (type, types.FunctionType)) else ""
    if "<lambda>" in name:
        return f"a lambda cannot be pickled ({detail})"
    if "<locals>" in name:
        return f"a function or class defined inside a function cannot be pickled ({detail})"
    return f"{_describe(value)}: {detail}"
