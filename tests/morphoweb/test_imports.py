"""The project's imports point one way: no module imports back into one that imports it."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"gpu_engine": REPO, "engine": REPO, "queries": REPO, "epochs": REPO, "policies": REPO,
            "morphoweb": REPO, "morpho_pir": REPO / "pir"}


def _modules() -> dict:
    modules = {}
    for package, root in PACKAGES.items():
        for path in (root / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def _graph(modules: dict) -> dict:
    """Module -> the project modules it imports, anywhere in it (a function's import too): `from
    a.b import c` imports a.b, whose __init__ runs, whatever c is."""
    def known(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(known(node.module))
        graph[name] = imported - {name, ""}
    return graph


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while not component or node not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_back_into_one_that_imports_it():
    graph = _graph(_modules())
    assert "gpu_engine.backends.factory" in graph["gpu_engine.placement"]
    assert _cycles(graph) == []


def test_the_engine_packages_import_no_django_app():
    graph = _graph(_modules())
    apps = ("engine", "queries", "epochs", "policies", "morphoweb")
    for name, imported in graph.items():
        if name.split(".")[0] in ("gpu_engine", "morpho_pir"):
            assert not [m for m in imported if m.split(".")[0] in apps], name
        if name.split(".")[0] == "morpho_pir":
            assert not [m for m in imported if m.startswith("gpu_engine")], name


def test_a_cycle_is_found_where_there_is_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
