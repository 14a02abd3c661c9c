"""ca_runtime's modules import each other without a circle (an AST scan of every import, local ones included)."""

from __future__ import annotations

import ast
import pathlib

import ca_runtime


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every module of the package at ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    targets.add(f"{base}.{alias.name}")
                elif base in modules:
                    targets.add(base)
    return targets - {name}


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_ca_runtime_has_no_import_circle() -> None:
    modules = _modules(pathlib.Path(ca_runtime.__file__).parent)
    assert len(modules) > 10
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "ca_runtime._state" in graph["ca_runtime._runtime"]  # the scan resolves the package's imports
    assert _circles(graph) == []


def test_the_scan_finds_a_circle() -> None:
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p.a", "p.c"}, "p.c": set()}
    assert _circles(graph) == [{"p.a", "p.b"}]
