"""Values between a real pool of CPU ranks and the kernel: what arrives, what is refused, and
that the ranks stay alive and idle after each (no mocks).

    python -m pytest tests/controller/test_values_travel.py -q
"""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest

from mnb.controller import Pool
from mnb.errors import CompositeRankError
from mnb.values import Unportable

pytestmark = pytest.mark.slow

CELL = """
class Point:
    def __init__(self, x):
        self.x = x

point = Point(rank)
relu = torch.nn.functional.relu
t = torch.arange(3, dtype=torch.bfloat16) + rank
model = torch.nn.Linear(2, 3)
mixed = {"lr": 0.1, "w": torch.ones(2) * rank, "f": relu, "cls": Point, "steps": [1, 2]}
"""
# Rank side without its safety net: values leave the rank exactly as they are.
UNGUARDED = ("import mnb.values as _values\n_kernel_safe = _values.kernel_safe\n"
             "_values.kernel_safe = lambda value: value")
GUARDED = "_values.kernel_safe = _kernel_safe"


@pytest.fixture(scope="module")
def pool(module_pool):
    """The session's 2-rank pool (tests/conftest.py) with CELL's values defined."""
    module_pool.run(CELL)
    return module_pool


def assert_usable(pool: Pool) -> None:
    assert pool.run("rank") == {0: 0, 1: 1}
    assert [row["state"] for row in pool.status()] == ["idle", "idle"]


def test_torch_function_arrives_as_a_note(pool):
    pulled = pool.pull("relu")
    assert all(repr(v).startswith("<not portable: torch function relu (") for v in pulled.values()), pulled
    assert_usable(pool)


def test_tensor_arrives_as_numpy(pool):
    pulled = pool.pull("t")
    assert (type(pulled[1]), pulled[1].tolist()) == (np.ndarray, [1.0, 2.0, 3.0])
    assert_usable(pool)


def test_model_arrives_as_a_note_showing_its_repr(pool):
    note = pool.pull("model", ranks=[0])[0]
    assert isinstance(note, Unportable) and "Linear(in_features=2, out_features=3" in note.repr
    assert_usable(pool)


def test_instance_of_a_cell_class_arrives_as_a_note(pool):
    note = pool.pull("point", ranks=[1])[1]
    assert "Point object (defined in a %%megatron cell" in repr(note)
    assert_usable(pool)


def test_mixed_dict_keeps_its_good_values(pool):
    mixed = pool.pull("mixed")[1]
    kinds = {k: type(v).__name__ for k, v in mixed.items()}
    assert (mixed["lr"], mixed["w"].tolist(), mixed["steps"]) == (0.1, [1.0, 1.0], [1, 2])
    assert kinds == {"lr": "float", "w": "ndarray", "f": "Unportable", "cls": "Unportable", "steps": "list"}
    assert_usable(pool)


def test_push_of_a_lambda_is_refused_before_any_rank_is_touched(pool):
    with pytest.raises(TypeError, match="cannot push 'f' to the ranks"):
        pool.push({"lr": 0.5, "f": lambda x: x})
    assert [info.state for _, info in sorted(pool.ranks.items())] == ["idle", "idle"]
    assert pool.run("'lr' in globals()") == {0: False, 1: False}  # nothing was bound
    assert_usable(pool)


def test_push_the_ranks_cannot_rebuild_is_an_error_that_binds_nothing(pool, monkeypatch):
    module = types.ModuleType("kernel_only")  # importable here, not on the ranks
    exec("class Config:\n    pass", module.__dict__)
    monkeypatch.setitem(sys.modules, "kernel_only", module)
    with pytest.raises(CompositeRankError, match=r"cannot rebuild 'cfg' \(nothing was bound\): cfg: ModuleNotFound"):
        pool.push({"lr2": 0.5, "cfg": module.Config()})
    assert pool.run("'lr2' in globals()") == {0: False, 1: False}
    assert_usable(pool)


def test_value_the_kernel_cannot_rebuild_is_one_error_naming_it(pool):
    pool.run(UNGUARDED)
    try:
        with pytest.raises(CompositeRankError) as info:
            pool.pull(["t", "relu"])
    finally:
        pool.run(GUARDED)
    error = info.value
    assert (error.ranks, "'relu' from rank(s) [0, 1]" in str(error)) == ([0, 1], True), str(error)
    assert_usable(pool)


def test_reply_that_cannot_be_encoded_is_an_error_not_a_death(pool):
    pool.run(UNGUARDED)
    try:
        with pytest.raises(CompositeRankError, match=r"could not handle 'execute'.*cannot pickle '_thread.lock'"):
            pool.run("import threading\nthreading.Lock()")
    finally:
        pool.run(GUARDED)
    assert_usable(pool)


def test_a_value_over_the_message_limit_stays_on_its_rank_and_the_cell_succeeds(pool, shell, capsys):
    """The last expression's value would pass the limit of one message: the cell still succeeds, a note
    saying where the value stays travels instead, and a caller that wants no value (%%megatron) gets none."""
    pool.run("import mnb.protocol as _protocol\n_limit = _protocol.MAX_MESSAGE_BYTES\n"
             "_protocol.MAX_MESSAGE_BYTES = 2**20")  # the ranks' limit of one message: 1 MiB
    try:
        noted = pool.run("big = torch.zeros(2**19)\nbig")  # 2 MiB of float32
        unsent = pool.run("big", want_value=False)
        capsys.readouterr()
        shown = shell.run_cell("%%megatron\nbig")
    finally:
        pool.run("_protocol.MAX_MESSAGE_BYTES = _limit")
    for rank, note in noted.items():
        assert isinstance(note, Unportable) and note.repr.startswith("tensor([0., 0., 0.,"), note
        assert f"over the 1.0 MiB limit of one message; it stays on rank {rank}" in note.reason, note.reason
        assert "pool.pull" in note.reason
    assert unsent == {0: None, 1: None}
    assert shown.success, shown.error_in_exec
    assert "tensor([0., 0., 0.," in capsys.readouterr().out
    assert_usable(pool)


def test_failing_pull_handler_is_an_error_not_a_death(pool):
    pool.run("import mnb.values as _values\n_encode = _values.encode_values\n"
             "def _broken(values):\n    raise RuntimeError('encoder broke')\n_values.encode_values = _broken")
    try:
        with pytest.raises(CompositeRankError, match="could not handle 'pull': encoder broke"):
            pool.pull("t")
    finally:
        pool.run("_values.encode_values = _encode")
    assert_usable(pool)


def test_kernel_never_imports_torch_when_pulling_a_torch_function(tmp_path):
    code = ("import sys\n"
            "from mnb.controller import Pool\n"
            f"pool = Pool.start(2, device='cpu', timeout=180, workdir={str(tmp_path)!r})\n"
            "try:\n"
            "    pool.run('relu = torch.nn.functional.relu')\n"
            "    print(type(pool.pull('relu')[0]).__name__)\n"
            "    print('torch' in sys.modules)\n"
            "finally:\n"
            "    pool.stop()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.split()[-2:] == ["Unportable", "False"], result.stdout + result.stderr
