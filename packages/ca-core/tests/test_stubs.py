"""The hand-written stubs (_C.pyi) match the extension, checked against nanobind's own stubgen.

The stubs are kept by hand because they type the seam more precisely than
nanobind can see (``Sequence[Tensor | None]`` where the C++ takes a handle).
What must not drift is checked here against what nanobind reports for the
built module: every exported name, every function's parameter names and
defaults, every class's fields.
"""

from __future__ import annotations

import ast
import enum
import pathlib

import ca_core
import pytest
from ca_core import _C


def _shape(tree: ast.Module) -> dict[str, object]:
    """name -> parameter names and defaults (functions), field names (classes), or "value"."""
    shape: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            args = node.args
            defaults = [ast.unparse(d) for d in args.defaults]
            shape[node.name] = ([a.arg for a in args.args], defaults)
        elif isinstance(node, ast.ClassDef):
            shape[node.name] = sorted(
                f.name for f in node.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("__")
            ) + sorted(_enum_members(node))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            shape[node.target.id] = "value"
    return shape


def _enum_members(cls: ast.ClassDef) -> list[str]:
    """The members of an enum class (``name = value`` lines; stubgen may annotate them)."""
    names = []
    for f in cls.body:
        if isinstance(f, ast.Assign) and isinstance(f.targets[0], ast.Name):
            names.append(f.targets[0].id)
        elif isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name):
            names.append(f.target.id)
    return names


def _hand_written() -> ast.Module:
    return ast.parse(pathlib.Path(ca_core.__file__).with_name("_C.pyi").read_text())


def test_stubs_match_extension() -> None:
    exported = {n for n in dir(_C) if not n.startswith("_")}
    assert set(_shape(_hand_written())) == exported


def test_stub_classes_list_every_field() -> None:
    for cls in (n for n in _hand_written().body if isinstance(n, ast.ClassDef)):
        runtime_cls = getattr(_C, cls.name)
        if isinstance(runtime_cls, enum.EnumMeta):
            assert set(_enum_members(cls)) == set(runtime_cls.__members__), cls.name
            continue
        fields = {f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
        runtime = {n for n in dir(runtime_cls) if not n.startswith("_")}
        assert fields == runtime, cls.name


def test_stubs_agree_with_nanobind_stubgen(tmp_path: pathlib.Path) -> None:
    stubgen = pytest.importorskip(
        "nanobind.stubgen", reason="nanobind (a build requirement) is not installed"
    )
    out = tmp_path / "_C.pyi"
    stubgen.main(["-m", "ca_core._C", "-o", str(out), "-q"])
    generated = _shape(ast.parse(out.read_text()))
    assert _shape(_hand_written()) == generated
