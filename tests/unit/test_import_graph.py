"""The package's import graph: layers import only downward — no circle, no sideways import between siblings.

Layers, top to bottom (docs/README.md draws the same map):

    cli → bench → train → estimate → {parallel, memory} → {models, data} → optim → config → untrusted → errors

`lstune.__main__` sits above cli and the package root (`lstune`, its version) below everything. Every
`import` counts, including the lazy ones inside functions, since they run too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lstune"
TIERS = [["errors"], ["untrusted"], ["config"], ["optim"], ["models", "data"], ["parallel", "memory"], ["estimate"], ["train"], ["bench"],
         ["cli"],
         ["__main__"]]
RANK = {unit: rank for rank, units in enumerate(TIERS) for unit in units}


def _unit(module: str) -> str | None:
    """The layer a dotted module belongs to (`lstune.memory.apply` → memory); None for the package root."""
    parts = module.split(".")
    if parts[0] != "lstune" or len(parts) == 1:
        return None
    return parts[1].removesuffix(".py")


def _module_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("lstune")}


def _edges() -> set[tuple[str, str]]:
    edges = set()
    for path in PACKAGE.rglob("*.py"):
        source = _unit(_module_of(path))
        for target_module in _imports(path):
            target = _unit(target_module)
            if source is not None and target is not None and target in RANK and source != target:
                edges.add((source, target))
    return edges


def test_every_layer_is_placed():
    units = {path.name.removesuffix(".py") for path in PACKAGE.iterdir()
             if path.name != "__init__.py" and (path.suffix == ".py" or (path / "__init__.py").exists())}
    assert units <= set(RANK), sorted(units - set(RANK))


@pytest.mark.parametrize("edge", sorted(_edges()), ids=lambda e: f"{e[0]}->{e[1]}")
def test_imports_only_go_down(edge):
    source, target = edge
    assert RANK[target] < RANK[source], f"lstune.{source} imports lstune.{target}: up or sideways"


def test_the_checker_sees_lazy_imports(tmp_path):
    """A function-level import counts: the checker must find it (otherwise every test above is vacuous)."""
    sample = tmp_path / "sample.py"
    sample.write_text("def f():\n    from lstune.train.run import train\n    import lstune.cli.app\n")
    assert _imports(sample) == {"lstune.train.run", "lstune.train.run.train", "lstune.cli.app"}
    assert ("models", "data") not in _edges()  # the byte tokenizer's sideways import is gone


def _module_graph() -> dict[str, set[str]]:
    """Module → the lstune modules it imports, each name resolved to the most specific module that exists
    (`from lstune.memory import mlp` is an edge to lstune.memory.mlp, not to the package)."""
    modules = {_module_of(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in _imports(path):
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph`, or None (depth-first search with the path on a stack)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished

    def visit(node, path):
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_module_imports_itself_round_a_circle():
    """Within a layer too: no module reaches itself through its imports (lazy ones count)."""
    assert _cycle(_module_graph()) is None, " → ".join(_cycle(_module_graph()))


def test_the_circle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
