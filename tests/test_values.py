"""mnb.values: which values travel from a rank to the notebook kernel, and what stays behind.

    python -m pytest tests/test_values.py -q

torch is imported here only to build rank-side values; that the kernel side
rebuilds them without torch is checked in a fresh interpreter.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest

from mnb.values import (
    NotKernelSafe,
    Unportable,
    ValueDecodeError,
    decode_values,
    encode_push,
    encode_values,
    kernel_safe,
    loads_safe,
)

torch = pytest.importorskip("torch")


def travel(value):
    """What the kernel gets when a rank sends ``value``."""
    return decode_values(encode_values({"v": value}))["v"]


# -- tensors and containers -----------------------------------------------------------------


def test_bf16_tensor_becomes_float32_numpy():
    value = travel(torch.arange(3, dtype=torch.bfloat16))
    assert (type(value), value.dtype.name, value.tolist()) == (np.ndarray, "float32", [0.0, 1.0, 2.0])


def test_int_tensor_keeps_its_dtype():
    assert travel(torch.arange(3)).dtype.name == "int64"


def test_parameter_that_requires_grad_becomes_numpy():
    assert travel(torch.nn.Parameter(torch.ones(2))).tolist() == [1.0, 1.0]


def test_containers_are_converted_element_by_element():
    value = travel({"a": [torch.ones(1), (torch.zeros(1),)], "size": torch.Size([2, 3]), "n": 4})
    got = (type(value["a"][0]), type(value["a"][1][0]), value["size"], value["n"])
    assert got == (np.ndarray, np.ndarray, (2, 3), 4)


def test_set_members_are_converted():
    assert travel({1, "a", (2, 3)}) == {1, "a", (2, 3)}


def test_tensor_dict_key_becomes_a_note_and_the_value_stays():
    (key, value), = travel({torch.ones(1): "one"}).items()
    assert (isinstance(key, Unportable), value) == (True, "one")


def test_nesting_past_the_depth_limit_keeps_plain_data():
    deep: list = [7]
    for _ in range(12):
        deep = [deep]
    assert travel(deep) == deep


def test_tensor_past_the_depth_limit_becomes_a_note_there():
    deep: list = [torch.ones(1)]
    for _ in range(12):
        deep = [deep]
    value = travel(deep)
    for _ in range(8):
        value = value[0]
    assert isinstance(value, Unportable) and "torch" in value.reason


# -- what becomes a note ----------------------------------------------------------------------


def test_torch_function_becomes_a_note_naming_it():
    assert repr(travel(torch.nn.functional.relu)).startswith("<not portable: torch function relu (")


def test_model_becomes_a_note_showing_its_repr():
    note = travel(torch.nn.Linear(2, 3))
    assert "Linear(in_features=2, out_features=3, bias=True)" in repr(note)


def test_cell_defined_class_instance_becomes_a_note():
    cls = type("Point", (), {"__module__": "__mnb__"})  # what a %%megatron cell defines
    assert "defined in a %%megatron cell" in travel(cls()).reason


def test_function_of_a_module_outside_the_list_becomes_a_note():
    assert "needs json.dumps" in travel(json.dumps).reason


def test_value_that_does_not_pickle_becomes_a_note():
    assert "cannot be pickled" in travel(threading.Lock()).reason


def test_broken_repr_does_not_break_the_note():
    class Broken:
        __module__ = "__mnb__"

        def __repr__(self):
            raise RuntimeError("no repr")

    assert "repr failed: RuntimeError: no repr" in travel(Broken()).repr


def test_long_repr_is_cut():
    note = kernel_safe(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(200)]))
    assert "more characters)" in note.repr and len(note.repr) < 4100


# -- plain data travels as is -------------------------------------------------------------------

PLAIN = {
    "datetime": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc),
    "timedelta": datetime.timedelta(seconds=3),
    "decimal": decimal.Decimal("1.25"),
    "fraction": fractions.Fraction(1, 3),
    "uuid": uuid.UUID(int=5),
    "path": pathlib.PurePosixPath("/data/x.bin"),
    "ordered": collections.OrderedDict(a=1),
    "deque": collections.deque([1, 2]),
    "counter": collections.Counter("aab"),
    "pattern": re.compile("a+", re.I),
    "complex": 1 + 2j,
    "range": range(3),
    "bytearray": bytearray(b"ab"),
    "frozenset": frozenset({1}),
    "exception": ValueError("bad"),
    "ellipsis": ...,
    "numpy scalar": np.float32(2.5),
    "unportable": Unportable("r", "why"),
}


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_plain_data_travels_unchanged(name):
    value = travel(PLAIN[name])
    assert (type(value), repr(value)) == (type(PLAIN[name]), repr(PLAIN[name]))


@pytest.mark.parametrize("array", [np.arange(4.0), np.array(["a", "b"]), np.array([1, None], dtype=object),
                                   np.ma.masked_array([1, 2], mask=[0, 1]),
                                   np.zeros(2, dtype=[("a", "i4"), ("b", "f8")])],
                         ids=["float", "str", "object", "masked", "structured"])
def test_numpy_arrays_travel_unchanged(array):
    value = travel(array)
    assert (type(value), value.dtype, value.tolist()) == (type(array), array.dtype, array.tolist())


def test_object_array_holding_a_tensor_becomes_a_note():
    assert "does not import torch" in travel(np.array([torch.ones(1), 2], dtype=object)).reason


# -- the kernel's unpickler ------------------------------------------------------------------------


@pytest.mark.parametrize("obj", [eval, getattr, __import__, os.system, torch.nn.functional.relu],
                         ids=["eval", "getattr", "__import__", "os.system", "relu"])
def test_loads_safe_refuses_globals_outside_the_list(obj):
    with pytest.raises(NotKernelSafe):
        loads_safe(pickle.dumps(obj))


def test_decode_names_the_failing_name_only():
    encoded = {"ok": pickle.dumps(1), "bad": pickle.dumps(torch.nn.functional.relu)}
    with pytest.raises(ValueDecodeError) as info:
        decode_values(encoded)
    assert (list(info.value.problems), info.value.decoded) == (["bad"], {"ok": 1})


def test_decode_error_says_what_the_kernel_would_import():
    with pytest.raises(ValueDecodeError, match=r"bad: torch\.nn\.functional\.relu .*import torch\.nn\.functional"):
        decode_values({"bad": pickle.dumps(torch.nn.functional.relu)})


def test_decoding_in_a_fresh_interpreter_imports_no_torch(tmp_path):
    sent = {"t": torch.ones(2, dtype=torch.bfloat16), "relu": torch.nn.functional.relu,
            "model": torch.nn.Linear(2, 2), "mixed": {"lr": 0.1, "w": torch.zeros(1)}}
    (tmp_path / "values.pkl").write_bytes(pickle.dumps(encode_values(sent)))
    code = ("import pickle, sys\n"
            "from mnb.values import decode_values\n"
            f"got = decode_values(pickle.loads(open({str(tmp_path / 'values.pkl')!r}, 'rb').read()))\n"
            "print(sorted(got), type(got['t']).__name__, type(got['relu']).__name__)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.splitlines() == ["['mixed', 'model', 'relu', 't'] ndarray Unportable", "[]"], result.stderr


# -- pushing: refused in the kernel, before anything is sent ------------------------------------------


def test_push_of_a_lambda_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"(?s)cannot push 'f' .*nothing was sent.*\n  f: a lambda.*%%megatron cell"):
        encode_push({"lr": 0.1, "f": lambda x: x})


def test_push_of_a_notebook_function_is_refused(monkeypatch):
    def notebook_fn():
        return 1

    notebook_fn.__module__, notebook_fn.__qualname__ = "__main__", "notebook_fn"
    monkeypatch.setattr(sys.modules["__main__"], "notebook_fn", notebook_fn, raising=False)
    pickle.dumps(notebook_fn)  # plain pickle accepts it; the ranks could not rebuild it
    with pytest.raises(TypeError, match="function notebook_fn is defined in the notebook"):
        encode_push({"fn": notebook_fn})


def test_push_of_an_open_file_and_a_lock_names_both(tmp_path):
    with open(tmp_path / "f.txt", "w") as handle, pytest.raises(TypeError, match=r"cannot push 'fh', 'lock' "):
        encode_push({"fh": handle, "lock": threading.Lock(), "n": 1})


def test_push_of_names_that_are_not_identifiers_is_refused():
    with pytest.raises(ValueError, match="not identifiers"):
        encode_push({"my-lr": 0.1})


def test_push_of_mnbs_own_names_is_refused_naming_them():
    from mnb.values import MNB_NAMES
    from mnb.worker.sandbox import MNB_NAMES as restored  # the names %mnb run puts back: the same list

    assert restored is MNB_NAMES
    with pytest.raises(ValueError, match=r"rebind mnb's own name\(s\) \['rank', 'dist'\] on the ranks \(nothing was sent\)"):
        encode_push({"lr": 0.1, "rank": 0, "dist": None})


def test_pushed_values_are_pickled_one_per_name():
    encoded = encode_push({"lr": 0.5, "a": np.arange(3)})
    assert (pickle.loads(encoded["lr"]), pickle.loads(encoded["a"]).tolist()) == (0.5, [0, 1, 2])
