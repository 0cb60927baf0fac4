"""The reference of every configuration field, made from the fields' own docstrings.

A field's docstring (the string literal under it in :mod:`mnb.config`) is the one place its meaning
is written; docs/config.md is generated from it, as docs/magics.md's help texts are generated
from the parsers, so the two cannot drift (tests/test_config.py compares them)::

    python -m mnb.config_reference --write     # rewrites docs/config.md

Standard library only: reads the source of :mod:`mnb.config` with :mod:`ast`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
import textwrap
from pathlib import Path

from mnb import config
from mnb.fields import choices

CLASSES = (config.ParallelConfig, config.ModelConfig, config.TrainConfig)
"""The configs a user names: layout, model, training."""

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def field_docs(cls: type) -> dict[str, str]:
    """``{field: its docstring}`` for the fields of dataclass ``cls`` that have one (whitespace folded)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "(required)"


def _cell(text: str) -> str:
    """Docstring text as a Markdown table cell: Sphinx roles as plain code, pipes escaped."""
    return re.sub(r":(?:func|mod|class|attr|meth|data):`", "`", text).replace("``", "`").replace("|", "\\|")


def markdown() -> str:
    """docs/config.md: one table per config class (field, type, default, meaning)."""
    out = ["# Configuration fields", "",
           "Generated from the fields' docstrings in `mnb/parallel_config.py` and `mnb/config.py` by",
           "`python -m mnb.config_reference --write`;",
           "edit the docstrings, not this file. `mnb.train(...)`, `mnb.gpt(...)` and `%%megatron` flags take",
           "these names; a value of the wrong type or outside a field's choices is refused where it is made.", ""]
    for cls in CLASSES:
        docs = field_docs(cls)
        summary = " ".join((inspect.getdoc(cls) or "").split("\n\n")[0].split())
        out += [f"## `{cls.__name__}`", "", _cell(summary), "", "| field | type | default | meaning |",
                "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            out.append(f"| `{f.name}` | `{_cell(kind)}` | `{_cell(_default(f))}` | {_cell(docs.get(f.name, ''))} |")
        out.append("")
    return "\n".join(out)


def undocumented() -> list[str]:
    """``Class.field`` for every field without a docstring, or whose docstring leaves out one of its
    ``Literal`` choices (each choice is named in the docstring, quoted)."""
    missing = []
    for cls in CLASSES:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            doc = docs.get(f.name)
            if not doc:
                missing.append(f"{cls.__name__}.{f.name}")
                continue
            try:
                offered = choices(cls, f.name)
            except KeyError:  # not a Literal field
                offered = ()
            for choice in offered:
                if choice is not None and repr(choice) not in doc and f'"{choice}"' not in doc:
                    missing.append(f"{cls.__name__}.{f.name} ({choice!r} not described)")
    return missing


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--write"]:
        DOC_PATH.write_text(markdown())
        print(f"wrote {DOC_PATH}")
        return 0
    if argv:
        print("usage: python -m mnb.config_reference [--write]", file=sys.stderr)
        return 2
    print(markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
