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
    ["titan.tools"],  # plan, verify, compare, download, generate, simulate
    ["titan.train"],
    ["titan.checkpoint"],
    ["titan.parallel", "titan.data", "titan.observe", "titan.optim"],
    ["titan.models"],
    ["titan.rng"],
    ["titan.config_keys", "titan.run_plan"],  # the recipe's keys described; what each rank computes
    ["titan.config"],
    ["titan.dtypes", "titan.hub"],  # a dtype's two spellings; a hub name's folder in the local HF cache
    ["titan.balance", "titan.errors", "titan.files", "titan.progress", "titan.schema"],
    ["titan.launcher"],  # what torchrun tells a process, read in one place
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


# The model contract: outside titan/models, a model is reached only through titan/models/contract.py.

# Llama's names that other objects titan reads also have: (name, the expression before the dot).
NOT_THE_MODEL = {
    ("dim", "p"),  # a DTensor placement's sharded dim
    ("dim", "want"),  # Tensor.dim()
    ("dim", "got"),
    ("layers", "rank"),  # titan plan's layer ids per rank
    ("layers", "r"),
}


def llama_names() -> set[str]:
    """The attributes of Llama's modules (children, parameters, buffers, the rest) and of its args that the
    contract's Args and Model do not declare."""
    import torch
    from torch import nn

    from titan.models import Args, ClippedAttention, Model
    from titan.models.llama import FLAVORS, Transformer

    with torch.device("meta"):
        model = Transformer(FLAVORS["debug"])
    own = [m for m in model.modules() if type(m).__module__.startswith("titan.models")]  # not nn.Linear, rng.Dropout
    names = set(dir(FLAVORS["debug"])).union(*(dir(m) for m in own)) - set(dir(nn.Module()))
    declared = {n for protocol in (Args, Model, ClippedAttention) for n in (*vars(protocol), *protocol.__annotations__)}
    return {n for n in names - declared if not n.startswith("_")}


def model_attribute_reads(sources: dict[str, str], names: set[str]) -> list[str]:
    """`file:line: expression` of every read of one of `names` as an attribute, but those in NOT_THE_MODEL."""
    found = []
    for path, source in sorted(sources.items()):
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in names
                and (node.attr, ast.unparse(node.value)) not in NOT_THE_MODEL
            ):
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def outside_the_models() -> dict[str, str]:
    files = (ROOT / "titan").rglob("*.py")
    return {str(p.relative_to(ROOT)): p.read_text() for p in files if "models" not in p.relative_to(ROOT).parts[:2]}


def test_nothing_outside_the_models_names_a_llama_attribute():
    """The trainer, titan/parallel, the tools and the rest use a model only as the contract declares (a name in
    NOT_THE_MODEL is another object's)."""
    names = llama_names()
    assert {"tok_embeddings", "layers", "output", "feed_forward", "dim", "attn_dropout"} <= names
    assert model_attribute_reads(outside_the_models(), names) == []


def test_the_contract_check_catches_a_llama_attribute():
    source = "def first(stage):\n    return stage.tok_embeddings is not None and stage.args.dim > 0\n"
    assert model_attribute_reads({"titan/x.py": source}, llama_names()) == [
        "titan/x.py:2: stage.tok_embeddings",
        "titan/x.py:2: stage.args.dim",
    ]
