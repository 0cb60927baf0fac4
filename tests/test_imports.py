"""No import circle inside the package: module-level and function-level imports alike.

The graph is built from the source with ``ast`` (nothing is imported): an edge ``a -> b``
for every ``import``/``from ... import`` in module ``a`` that names module ``b`` of mnb,
wherever it stands (module level, inside a function, a ``try``).  Not edges:

- imports under ``if TYPE_CHECKING:`` (never executed; type hints only);
- imports of the root package ``mnb`` itself: it is the lazy facade every ``import mnb.x``
  passes through anyway, and it imports nothing at module level (checked below).

A circle that is known and owned elsewhere is listed in ``ALLOWED`` with its reason; the test
fails when such a circle disappears too, so the list stays true.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mnb"

ALLOWED: dict[frozenset[str], str] = {}
"""{circle: why it stays}.  Empty: the explorer (layout_explorer) imports its view, its pool runner
and choices, and none of them imports it back (the view knows only what it shows and two callbacks)."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import node, skipping ``if TYPE_CHECKING:`` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node):
            for other in node.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]))
        else:
            yield from _imports(node)


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = set()
    for alias in node.names:
        name = f"{source}.{alias.name}"
        out.add(name if name in modules else source)  # a submodule, else a name of ``source``
    return {t for t in out if t in modules}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in _imports(tree):
            edges |= _targets(module, path, node, modules)
        graph[module] = edges - {module, "mnb"}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    return "; ".join(f"{m} -> {sorted(graph[m] & component)}" for m in sorted(component))


def test_no_import_circle():
    graph = import_graph()
    found = circles(graph)
    unexpected = [c for c in found if c not in ALLOWED]
    assert not unexpected, "import circles:\n" + "\n".join(_describe(c, graph) for c in unexpected)


def test_allowed_circles_still_exist():
    """An exception that no longer applies is removed from ALLOWED."""
    found = circles(import_graph())
    stale = [sorted(c) for c in ALLOWED if c not in found]
    assert not stale, f"no longer a circle, remove from ALLOWED: {stale}"


def test_root_package_imports_nothing_of_mnb_at_module_level():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    modules = _modules()
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    named = set().union(*(_targets("mnb", PACKAGE / "__init__.py", n, modules) for n in top)) if top else set()
    assert not named, f"mnb/__init__.py must stay lazy; it imports {sorted(named)} at module level"


def test_graph_sees_function_level_imports():
    """The checker itself: an import inside a function is an edge."""
    assert "mnb.notebook.magics" in import_graph()["mnb"]  # load_ipython_extension imports it when called
    tree = ast.parse("def f():\n    from mnb.runs import Run\n")
    edges = set().union(*(_targets("mnb.x", PACKAGE / "x.py", n, _modules()) for n in _imports(tree)))
    assert edges == {"mnb.runs"}
    hidden = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mnb.runs import Run\n")
    assert not set().union(*(_targets("mnb.x", PACKAGE / "x.py", n, _modules()) for n in _imports(hidden)))


# ------------------------------------------------------------------ who may import whom
RANK_SIDE = ("mnb.worker", "mnb.megatron")
"""Run inside the ranks: they import torch and Megatron.  Everything else runs in the kernel."""
HEAVY = ("torch", "megatron", "transformer_engine", "apex")
"""Third-party packages the notebook kernel never imports (tests/test_no_torch.py checks a real import)."""

OLD_FRONT_END = ("mnb.magics", "mnb.magic_parsers", "mnb.magic_help", "mnb.pool_commands", "mnb.run_commands",
                 "mnb.debug_commands", "mnb.plan_commands", "mnb.profile_commands", "mnb.profiles", "mnb.workshop",
                 "mnb.config_reference")
"""Where the front end's modules stood before ``mnb/notebook/``: each re-exports its new home."""
OLD_ANALYSIS = ("mnb.runs", "mnb.run_memory", "mnb.run_pipeline", "mnb.run_summary")
"""Where a run's analysis stood before ``mnb/analysis/``: each re-exports its new home."""
OLD_EXPORT = ("mnb.exports", "mnb.export_args")
"""Where the export stood before ``mnb/megatron_lm/``: each re-exports its new home."""
OLD_PATHS = {"mnb.notebook": OLD_FRONT_END, "mnb.analysis": OLD_ANALYSIS, "mnb.megatron_lm": OLD_EXPORT}
"""{new package: the old modules of the root that re-export its modules}."""

GROUPS: dict[str, tuple[str, ...]] = {
    "shared types": ("mnb.config", "mnb.pipeline_layout", "mnb.lora_config", "mnb.fields", "mnb.units", "mnb.values", "mnb.protocol", "mnb.errors",
                     "mnb.timeouts", "mnb.version", "mnb.progress", "mnb.results", "mnb.writes", "mnb.hf_config",
                     "mnb.model_source", "mnb.paths", "mnb.presets", "mnb.profile_steps",
                     "mnb.parallel_config", "mnb.notices"),
    "front end": ("mnb.notebook",) + OLD_FRONT_END,
    "old front-end paths": OLD_FRONT_END,
    "old analysis paths": OLD_ANALYSIS,
    "old export paths": OLD_EXPORT,
    "rank side": RANK_SIDE,
}
"""Names for sets of modules in LAYERS.  shared types: the level-1 modules of the root that both sides use
(configs, units, values on the wire, errors, json-only config readers); front end: the magics' package and
the old paths that re-export it."""

LAYERS: list[tuple[str, str, tuple[str, ...], str]] = [
    ("shared types", "only", ("shared types",), "level 1: below everything, they import only each other"),
    ("mnb.controller", "only", ("mnb.controller", "shared types", "mnb.analysis", "mnb.launch_templates"),
     "the pool: driven by the front end, widgets and export, never the other way; never the rank side"),
    ("mnb.worker", "only", ("rank side", "shared types"),
     "the rank's loop drives mnb.megatron; never the controller, the front end or the notebook's analysis"),
    ("mnb.megatron", "only", ("mnb.megatron", "shared types", "mnb.estimate"),
     "never the worker (it installs its event sink in mnb.megatron.events), never the notebook side; the "
     "estimators' pure counts (e.g. LoRA's adapter parameters) have one owner, read on both sides"),
    ("mnb.estimate", "only", ("mnb.estimate", "mnb.config", "mnb.units", "mnb.model_source", "mnb.hf_config"),
     "pure functions of the configs (a preset or a checkpoint's config.json): usable without a pool, a run or matplotlib"),
    ("mnb.model_source", "only", ("mnb.config", "mnb.hf_config", "mnb.units"),
     "a model name or folder to a ModelConfig, json only"),
    ("mnb.hf_config", "only", ("mnb.config", "mnb.units"),
     "config.json to a ModelConfig, json only; the rank side reads it too"),
    ("mnb.plot", "only", ("mnb.plot", "mnb.estimate", "mnb.config", "mnb.units"),
     "figures of estimates and of any object with a run's fields (analysis.runs.as_run coerces; it imports plot)"),
    ("mnb.analysis", "only", ("mnb.analysis", "mnb.estimate", "mnb.plot", "shared types"),
     "a run's records, their analysis and summary text: below the pool (its registry makes a Run of the records)"),
    ("mnb.widgets", "only", ("mnb.widgets", "mnb.controller", "mnb.estimate", "mnb.plot", "mnb.analysis", "shared types"),
     "views that drive the pool and read estimates and runs; never the front end or the export"),
    ("mnb.notebook", "only", ("mnb.notebook", "mnb.controller", "mnb.widgets", "mnb.estimate", "mnb.plot",
                              "mnb.megatron_lm", "shared types"),
     "the magics parse, check and hand over: to the pool, the estimate, the export, the live widget; the profiles, "
     "the workshop's checks and the config reference are the notebook's own"),
    ("old front-end paths", "only", ("mnb.notebook",), "re-exports that keep the old import paths working"),
    ("old analysis paths", "only", ("mnb.analysis",), "re-exports that keep the old import paths working"),
    ("mnb.megatron_lm", "only", ("mnb.megatron_lm", "mnb.controller", "mnb.estimate", "mnb.launch_templates",
                                 "shared types"),
     "the export reads the notebook's last settings from the pool's registry; nothing below the front end imports it"),
    ("old export paths", "only", ("mnb.megatron_lm",), "re-exports that keep the old import paths working"),
    ("mnb.launch_templates", "only", ("mnb.paths",), "below both the Slurm launcher and the export"),
    ("notebook side", "never", ("rank side",), "the kernel never imports torch (the rank side does)"),
    ("all but the front end", "never", ("front end",), "nothing below the magics imports them (the facade aside)"),
]
"""(package or group, "never"/"only", packages or groups, why): the table in docs/architecture.md, row for row."""


def _expand(packages: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(m for p in packages for m in GROUPS.get(p, (p,)))


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in _expand(packages))


def _members(package: str, graph: dict[str, set[str]]) -> list[str]:
    if package == "notebook side":
        return sorted(m for m in graph if m != "mnb" and not _in(m, RANK_SIDE))
    if package == "all but the front end":
        return sorted(m for m in graph if m != "mnb" and not _in(m, ("front end",)))
    return sorted(m for m in graph if _in(m, (package,)))


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for package, kind, packages, why in LAYERS:
        for module in _members(package, graph):
            bad = sorted(t for t in graph[module] if _in(t, packages) != (kind == "only"))
            if bad:
                found.append(f"{module} imports {bad}: {package} {kind} imports {list(packages)} ({why})")
    return found


def _third_party(tree: ast.AST) -> set[str]:
    out = set()
    for node in _imports(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_layers():
    """The layering table holds, for module-level and function-level imports alike."""
    assert not layer_violations(import_graph()), "\n".join(layer_violations(import_graph()))


def test_layer_check_sees_a_violation():
    """The checker itself: what an allow-list leaves out is caught (the export, the widgets or a magic in the
    controller, the controller in the worker, the worker in mnb.megatron, a pool in a shared type, the rank
    side in the front end, anything but the front end in an old front-end path)."""
    graph = {"mnb.controller.x": {"mnb.megatron_lm.exports", "mnb.config"}, "mnb.estimate.y": {"mnb.runs"},
             "mnb.worker.z": {"mnb.controller.pool", "mnb.megatron.layout", "mnb.protocol"},
             "mnb.megatron.w": {"mnb.worker.channel", "mnb.config"}, "mnb.fields": {"mnb.controller"},
             "mnb.controller.v": {"mnb.widgets.live", "mnb.notebook.pool_commands"},
             "mnb.notebook.u": {"mnb.megatron.model", "mnb.controller"}, "mnb.magics": {"mnb.controller"}}
    found = layer_violations(graph)
    assert [line.split(":")[0] for line in found] == [
        "mnb.fields imports ['mnb.controller']",
        "mnb.controller.v imports ['mnb.notebook.pool_commands', 'mnb.widgets.live']",
        "mnb.controller.x imports ['mnb.megatron_lm.exports']",
        "mnb.worker.z imports ['mnb.controller.pool']",
        "mnb.megatron.w imports ['mnb.worker.channel']",
        "mnb.estimate.y imports ['mnb.runs']",
        "mnb.notebook.u imports ['mnb.megatron.model']",
        "mnb.magics imports ['mnb.controller']",
        "mnb.notebook.u imports ['mnb.megatron.model']",
        "mnb.controller.v imports ['mnb.notebook.pool_commands']",
    ], found


def test_notebook_side_never_imports_torch():
    offenders = {}
    for module, path in _modules().items():
        if not _in(module, RANK_SIDE):
            heavy = _third_party(ast.parse(path.read_text(), filename=str(path))) & set(HEAVY)
            if heavy:
                offenders[module] = sorted(heavy)
    assert not offenders, offenders


def test_architecture_doc_shows_the_layering_table():
    """docs/architecture.md states LAYERS row for row, so the table and the test cannot drift apart."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = doc.split("\n## Layering\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and " imports " in line]
    want = [f"| {_shown(package)} | {kind} imports {', '.join(_shown(p) for p in packages)} | {why} |"
            for package, kind, packages, why in LAYERS]
    assert rows == want, "\n".join(want)
    groups = [f"- {name}: {', '.join(_shown(m) for m in members)}" for name, members in GROUPS.items()]
    assert all(line in section.splitlines() for line in groups), "\n".join(groups)


def _shown(name: str) -> str:
    return f"`{name}`" if name.startswith("mnb") else name


def test_old_paths_name_the_new_objects():
    """``from mnb.magics import X``, ``from mnb.runs import X`` (and the other old paths) still work, and X is the
    new home's own object: every public name the new module defines is re-exported, none is a copy."""
    import importlib

    graph = import_graph()
    for package, olds in OLD_PATHS.items():
        for old in olds:
            (new,) = graph[old]
            assert new.startswith(package + "."), (old, new)
            tree = ast.parse(_modules()[new].read_text())
            defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
                t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
            public = {name for name in defined if not name.startswith("_")}
            old_module, new_module = importlib.import_module(old), importlib.import_module(new)
            assert public <= set(old_module.__all__), (old, sorted(public - set(old_module.__all__)))
            for name in old_module.__all__:
                assert getattr(old_module, name) is getattr(new_module, name), (old, name)
