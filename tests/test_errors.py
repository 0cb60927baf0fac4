"""mnb's exceptions travel: pickle (logging handlers, process pools) and copy.deepcopy keep every field."""

from __future__ import annotations

import copy
import pickle
from dataclasses import fields

import pytest

from mnb.errors import (CellTimeoutError, CompositeRankError, PoolError, RankDiedError, RankError, RequestRefused,
                        interrupted)
from mnb.protocol import MessageTooLarge, ProtocolError
from mnb.values import NotKernelSafe, PushRefused, ValueDecodeError


def _composite() -> CompositeRankError:
    root = RankError(rank=1, ename="ValueError", evalue="bad lr", traceback="Traceback ...\nValueError: bad lr\n",
                     label="r1 tp1 pp0 dp0")
    other = RankError(3, "RuntimeError", "gloo timed out", "Traceback ...\n", "r3 tp1 pp1 dp0")
    error = CompositeRankError(errors=[root, other], cell_ranks=[0, 1, 2, 3], headline="",
                               waiting={0: "cell line 3 `dist.barrier()`"}, notes=["restarted ranks 2, 3"])
    error.add_note("a note added later")
    return error


def _same(a: BaseException, b: BaseException) -> None:
    assert type(a) is type(b) and str(a) == str(b) and a.args == b.args
    def plain(e):
        return {k: v for k, v in vars(e).items() if not callable(v)}

    assert plain(a) == plain(b) and set(vars(a)) == set(vars(b))


@pytest.mark.parametrize("travel", ["pickle", "deepcopy"])
def test_rank_errors_keep_every_field(travel):
    move = (lambda e: pickle.loads(pickle.dumps(e))) if travel == "pickle" else copy.deepcopy
    error = _composite()
    moved = move(error)
    assert moved is not error and type(moved) is CompositeRankError
    for f in fields(CompositeRankError):
        if f.name != "errors":
            assert getattr(moved, f.name) == getattr(error, f.name), f.name
    assert len(moved.errors) == 2
    for mine, theirs in zip(error.errors, moved.errors):
        assert type(theirs) is RankError
        assert {f.name: getattr(theirs, f.name) for f in fields(RankError)} == \
               {f.name: getattr(mine, f.name) for f in fields(RankError)}
        assert str(theirs) == str(mine)
    assert moved.__notes__ == ["a note added later"]
    assert str(moved) == str(error) and moved._render_traceback_() == error._render_traceback_()
    assert moved.root_cause.rank == 1


@pytest.mark.parametrize("travel", ["pickle", "deepcopy"])
def test_every_other_mnb_error_travels(travel):
    move = (lambda e: pickle.loads(pickle.dumps(e))) if travel == "pickle" else copy.deepcopy
    from mnb.megatron.adopt import ScriptGroupError
    from mnb.megatron.checkpoint import DamagedCheckpointError

    errors = [
        RankError(0, "KeyError", "'x'"),
        RequestRefused("changing the layout needs every rank"), PoolError("no pool: %mnb start"),
        RankDiedError("rank 1 died (SIGKILL)", deaths={1: "SIGKILL"}),
        CellTimeoutError("cell timed out after 5 s", stacks={0: "File cell, line 1"}),
        ProtocolError("bad signature"), MessageTooLarge("reply", 300 * 2**20, 256 * 2**20),
        NotKernelSafe("torch", "Tensor"), ValueDecodeError({"x": "torch.Tensor ..."}, {"y": 1}),
        PushRefused("f is defined in the notebook"), DamagedCheckpointError("checkpoint c is damaged"),
        ScriptGroupError("the script asks for ranks [0, 5]"), interrupted("stopped after step 3"),
    ]
    for error in errors:
        moved = move(error)
        _same(error, moved)
    assert move(errors[6]).size_bytes == 300 * 2**20 and move(errors[8]).decoded == {"y": 1}
    assert move(errors[3]).deaths == {1: "SIGKILL"} and move(errors[7]).module == "torch"
    assert move(errors[-1])._render_traceback_() == ["KeyboardInterrupt: stopped after step 3"]


def test_pool_errors_show_their_own_class_name():
    """A timed-out cell reads ``CellTimeoutError: ...`` in the notebook, the name ``except`` would catch."""
    timeout = CellTimeoutError("cell timed out after 5 s; rank(s) [0] had not finished.\n  [r0] at cell line 1\n"
                               "Python stack of [r0]:\n  File cell, line 1\nmnb is restarting all 2 ranks")
    lines = timeout._render_traceback_()
    assert lines[0] == "\x1b[31mCellTimeoutError: cell timed out after 5 s; rank(s) [0] had not finished.\x1b[0m"
    assert lines[1:] == ["  [r0] at cell line 1", "mnb is restarting all 2 ranks",
                         "(each rank's Python stack: error.stacks, or %mnb stacks)"]
    assert RankDiedError("rank 1 died")._render_traceback_() == ["\x1b[31mRankDiedError: rank 1 died\x1b[0m"]


def test_every_exception_class_mnb_defines_lives_in_mnb_errors_and_keeps_its_old_import_path():
    """A user catches mnb's errors from one module; where one was defined before, it still imports."""
    import ast
    import builtins
    import importlib
    from pathlib import Path

    import mnb.errors

    root = Path(mnb.errors.__file__).parent
    exception_names = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    exception_names |= {"UnpicklingError"}
    internal = {"NotKernelSafe"}  # raised inside values.loads_safe, reaches users as ValueDecodeError's text
    defined = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                if bases & exception_names:
                    exception_names.add(node.name)
                    defined.setdefault(node.name, path)
    # a second pass: subclasses of mnb's own errors defined before their bases were seen
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
                if bases & exception_names:
                    defined.setdefault(node.name, path)
    elsewhere = {name: str(path.relative_to(root)) for name, path in defined.items()
                 if path.name != "errors.py" and name not in internal and not name.startswith("_")}
    assert elsewhere == {}, f"define these in mnb/errors.py: {elsewhere}"
    for module, name in [("mnb.protocol", "ProtocolError"), ("mnb.protocol", "MessageTooLarge"),
                         ("mnb.values", "PushRefused"), ("mnb.values", "ValueDecodeError"),
                         ("mnb.worker.stdin", "NoStdinError"), ("mnb.megatron.checkpoint", "DamagedCheckpointError"),
                         ("mnb.megatron.gpu_idioms", "CudaStreamError"), ("mnb.megatron.adopt", "ScriptGroupError"),
                         ("mnb.controller.repair", "LayoutRefused")]:
        assert getattr(importlib.import_module(module), name) is getattr(mnb.errors, name), (module, name)
