"""Refuse impossible Megatron configurations before a cell reaches the ranks.

A cell such as ``model = mnb.gpt("llama-8b", num_layers=30)`` under
``--pp 4`` cannot work, and on the ranks it would fail only after the layout
was re-initialised and memory allocated.  The controller reads the cell's
syntax tree, evaluates the *literal* arguments of ``mnb.gpt(...)`` and
``mnb.train(...)`` calls, and checks them against the requested layout with
the same rules the rank side uses (:mod:`mnb.config`).  Arguments that are not
literals are left to the ranks, which check again.
"""

from __future__ import annotations

import ast
from typing import Any

from mnb.config import ParallelConfig, TrainConfig, interleave_problem, model_config, train_settings_problem
from mnb.model_source import tokenizer_folder

_MODEL_FUNCS = {"gpt"}
_TRAIN_FUNCS = {"train"}
_GPT_OWN_ARGS = {"seed", "init", "fusions", "sequence_parallel"}
"""Arguments of ``mnb.gpt`` that are not model settings (the layout's, or how weights are made)."""


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "mnb":
        return func.attr
    return None


def _literal_kwargs(node: ast.Call) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            continue
        try:
            values[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            continue
    return values


def check_cell(code: str, parallel: ParallelConfig) -> list[str]:
    """Problems found in ``code`` for ``parallel`` (resolved); empty when none can be proven."""
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        return [f"the cell has a syntax error at line {exc.lineno}: {exc.msg}"]
    problems: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _call_name(node)
        if name in _MODEL_FUNCS and node.args:
            try:
                preset = ast.literal_eval(node.args[0])
            except ValueError:
                continue
            kwargs = _literal_kwargs(node)
            try:
                config = model_config(preset, **kwargs)
                sp = kwargs.get("sequence_parallel", parallel.sequence_parallel)
                config.check_parallel(ParallelConfig(**{**parallel.as_dict(), "sequence_parallel": bool(sp)}))
            except (ValueError, TypeError) as exc:
                problems.append(f"mnb.gpt({preset!r}) under {parallel.describe()}: {exc}")
        elif name in _TRAIN_FUNCS:
            kwargs = _literal_kwargs(node)
            fields = set(TrainConfig.__dataclass_fields__)
            names = [k.arg for k in node.keywords if k.arg is not None]  # literal or not: a name is a name
            problem = train_settings_problem(names)
            if problem:
                problems.append(f"mnb.train(...): {problem}")
                continue
            try:
                train = TrainConfig(**{k: v for k, v in kwargs.items() if k in fields})
                m = train.num_microbatches(parallel.dp or 1)
            except (ValueError, TypeError) as exc:
                problems.append(f"mnb.train(...) under {parallel.describe()}: {exc}")
                continue
            problem = interleave_problem(m, parallel.pp, parallel.vpp, train.micro_batch_size * (parallel.dp or 1))
            if problem:
                problems.append(f"mnb.train(...) under {parallel.describe()}: {problem}")
    return problems


def cell_settings(code: str) -> dict[str, dict[str, Any]]:
    """The settings of the cell's last ``mnb.gpt(...)``/``mnb.from_hf(...)`` and ``mnb.train(...)``, when all
    their arguments are literals.

    ``{"model": ModelConfig fields, "tokenizer": folder or None, "train": TrainConfig fields}``,
    model and train each missing when the cell has no such call or one with a non-literal
    argument (what the ranks computed is then known only from the run records); ``tokenizer``
    comes with ``model``: the checkpoint folder of ``mnb.from_hf(PATH)`` when it holds a
    ``tokenizer.json``, else None.  ``%mnb export`` starts from these.
    """
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return {}
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)
                    and _call_name(n) in ("gpt", "from_hf", "train")),
                   key=lambda n: (n.lineno, n.col_offset))
    found: dict[str, dict[str, Any]] = {}
    for node in calls:
        kwargs = _literal_kwargs(node)
        if len(kwargs) != len(node.keywords):
            continue  # a non-literal or **kwargs argument
        try:
            if _call_name(node) == "gpt" and len(node.args) == 1:
                model = {k: v for k, v in kwargs.items() if k not in _GPT_OWN_ARGS}
                found["model"] = model_config(ast.literal_eval(node.args[0]), **model).to_dict()
                found["tokenizer"] = None
            elif _call_name(node) == "from_hf" and len(node.args) == 1:
                from mnb.hf_config import hf_config

                path = ast.literal_eval(node.args[0])
                found["model"] = hf_config(path, **kwargs).to_dict()
                found["tokenizer"] = tokenizer_folder(path)
            elif _call_name(node) == "train" and len(node.args) <= 1:
                found["train"] = TrainConfig(**kwargs).to_dict()
        except (ValueError, TypeError):
            continue
    return found
