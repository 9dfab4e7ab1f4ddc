"""titan's layering: a module imports only from lower layers or from its own component, the components of one
layer do not import each other, and no modules import each other in a cycle. Imports inside functions count:
they are the same dependency, only later."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

# Top to bottom. A component is a package or a module; those of one layer are independent of each other.
LAYERS = [
    ["titan.__main__"],  # python -m titan
    ["titan.cli"],
    ["titan.tools"],  # plan, verify, compare, generate, simulate
    ["titan.train"],
    ["titan.checkpoint"],
    ["titan.parallel", "titan.data", "titan.observe", "titan.optim"],
    ["titan.models"],
    ["titan.rng"],
    ["titan.config_keys", "titan.run_plan"],  # the recipe's keys described; what each rank computes
    ["titan.config"],
    ["titan.balance", "titan.errors", "titan.files"],
    ["titan"],  # the package's own __init__: its version
]


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, importer: str, modules: set[str]) -> set[str]:
    """The titan modules `source` imports, wherever in it (`from titan.x import y` is titan.x.y when that is a
    module, else titan.x)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "titan")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "titan":
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
    return {m for m in found if m != importer}


def import_graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in (root / "titan").rglob("*.py")}
    return {name: imports(path.read_text(), name, set(files)) for name, path in files.items()}


def component(module: str) -> tuple[int, str]:
    """(layer index, component) of a module: the longest component that is it or contains it."""
    matches = [
        (len(c), i, c) for i, layer in enumerate(LAYERS) for c in layer if module == c or module.startswith(c + ".")
    ]
    _, layer, name = max(matches)
    return layer, name


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for importer, imported in sorted(graph.items()):
        layer, own = component(importer)
        for module in sorted(imported):
            other_layer, other = component(module)
            if other_layer < layer:
                problems.append(f"{importer} imports {module}, a higher layer ({other})")
            elif other_layer == layer and other != own:
                problems.append(f"{importer} imports {module}: {own} and {other} are one layer's independent parts")
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_belongs_to_a_layer():
    graph = import_graph(ROOT)
    for module in graph:
        component(module)  # raises where no component holds it


def test_no_module_imports_a_higher_layer_or_a_sibling():
    assert layer_violations(import_graph(ROOT)) == []


def test_no_modules_import_each_other():
    assert cycles(import_graph(ROOT)) == []


def test_the_checks_catch_an_upward_import_and_a_cycle():
    upward = import_graph(ROOT)
    upward["titan.config"] |= imports("from titan.train.trainer import Trainer", "titan.config", set(upward))
    assert layer_violations(upward) == ["titan.config imports titan.train.trainer, a higher layer (titan.train)"]
    mutual = import_graph(ROOT)
    mutual["titan.data.corpora"] |= {"titan.data.tokenizer"}  # the tokenizer imports the corpora
    assert cycles(mutual) == [["titan.data.corpora", "titan.data.tokenizer"]]
