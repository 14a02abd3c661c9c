"""The hand-written stubs (_C.pyi) name exactly what the extension exports."""

from __future__ import annotations

import ast
import pathlib

import ca_core
from ca_core import _C


def _stub_names() -> set[str]:
    stub = pathlib.Path(ca_core.__file__).with_name("_C.pyi")
    tree = ast.parse(stub.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_stubs_match_extension() -> None:
    exported = {n for n in dir(_C) if not n.startswith("_")}
    assert _stub_names() == exported


def test_stub_classes_list_every_field() -> None:
    stub = pathlib.Path(ca_core.__file__).with_name("_C.pyi")
    tree = ast.parse(stub.read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        fields = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}
        runtime = {n for n in dir(getattr(_C, cls.name)) if not n.startswith("_")}
        assert fields == runtime, cls.name
