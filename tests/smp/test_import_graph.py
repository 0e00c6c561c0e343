"""No import circles in `smp/` or `frontends/` (torch and tensorflow), and the core never imports a frontend (issue 10).

The imports are read with `ast`, never executed, so the test needs no framework. Every import
counts: module level, inside functions and under ``if TYPE_CHECKING:``, absolute and relative.
``import a.b`` is an edge to ``a.b``; ``from a import b`` is an edge to ``a.b`` when that is a module,
else to ``a``. The parent packages Python runs on the way (``a/__init__``) are not edges: a package
``__init__`` re-exporting its submodules is the normal shape, not a circle. The tree is mapped as
setup.py installs it (``frontends/torch/X`` is ``smp.torch.X``).

A string handed to `importlib.import_module` at call time is not an import here; that is how the
core reaches frontend code without depending on it (the ``PLAN_PROVIDERS`` registry in
`smp.cli`).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"smp": REPO / "smp", "smp.torch": REPO / "frontends" / "torch",
         "smp.tensorflow": REPO / "frontends" / "tensorflow"}
FRONTENDS = ("smp.torch", "smp.tensorflow")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is a package ``__init__``)."""
    found: dict[str, tuple[Path, bool]] = {}
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([package, *parts])] = (path, is_package)
    return found


MODULES = _modules()


def _imports(name: str, path: Path, is_package: bool) -> list[tuple[str, int]]:
    """(imported module, line) for every import statement in the file, wherever it sits."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                full = f"{module}.{alias.name}"
                found.append((full if full in MODULES else module, node.lineno))
    return found


def _graph() -> dict[str, dict[str, int]]:
    """Module -> {imported module of this tree: first line}."""
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in MODULES.items():
        edges = graph.setdefault(name, {})
        for target, line in _imports(name, path, is_package):
            if target != name and target in MODULES:
                edges.setdefault(target, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(component)
    edges = [
        f"    {a} -> {b}  ({MODULES[a][0].relative_to(REPO)}:{line})"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in members
    ]
    return "circle of " + ", ".join(component) + ":\n" + "\n".join(edges)


def test_the_walker_sees_every_kind_of_import() -> None:
    graph = _graph()
    assert "smp.torch" in MODULES and "smp.pipeline.plan" in MODULES and "smp.torch.tp.marking" in MODULES
    assert "smp.pipeline.plan" in graph["smp.pipeline.grid"]  # absolute, module level
    assert "smp.torch.model.delayed" in graph["smp.torch.tp.marking"]  # absolute smp.torch.X, in a function
    assert "smp.torch.tp" in graph["smp.torch"]  # relative package import from an __init__
    assert "smp.torch.nn.group" in graph["smp.torch.model.delayed"]  # relative, in a function


def test_no_import_circles() -> None:
    graph = _graph()
    problems = [_describe(c, graph) for c in _cycles(graph)]
    assert not problems, "import circles (break them; see issue 10 item 4):\n" + "\n".join(problems)


def test_the_core_never_imports_a_frontend() -> None:
    graph = _graph()
    bad = [
        f"{a} -> {b}  ({MODULES[a][0].relative_to(REPO)}:{line})"
        for a, edges in graph.items()
        if not a.startswith(FRONTENDS)
        for b, line in edges.items()
        if b.startswith(FRONTENDS)
    ]
    assert not bad, "the core imports a frontend (use a lazy registry, as smp.cli does):\n" + "\n".join(bad)


def test_the_cycle_finder_reports_circles() -> None:
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}, "e": {"e": 5}}
    assert _cycles(graph) == [["a", "b", "c"]]
