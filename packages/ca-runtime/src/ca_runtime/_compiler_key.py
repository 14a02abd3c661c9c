"""Which cache a ``compiler_fn`` serves its backwards from (its compiler key).

[Note: Compilers made anew]
ca_core keeps one cache tree per compiler (see [Note: One cache per compiler]
in ca_core). A backend name is its own key ("backend:inductor"). A callable
is keyed by what it computes, so that code that makes its compiler anew each
step (``with enable(lambda gm: torch.compile(gm, backend="inductor")):``
inside the loop, the shape of torch's own tests) finds its earlier captures:

- a function is its code object, its defaults and the values in its closure
  cells; ``functools.partial`` its function and arguments; a bound method
  its function and its ``__self__``;
- a ``torch.compile`` context (which ``torch._dynamo.config.compiled_autograd``
  makes anew for every call of a compiled function) is its backend and
  ``dynamic``;
- a value is equal by value if it is a simple one (None, bool, int, float,
  complex, str, bytes, a torch dtype/device/layout/memory format, an enum
  member, or a tuple/frozenset of these) and a function, partial or method
  is compared as above, recursively (a cycle back to a function on the way
  is compared by position);
- anything else (a compiler object, a list, a module) is compared by
  identity: it is an *anchor* of the key.

Two compilers with equal fingerprints share a key, and so a cache. A key
lives as long as its anchors: a weakly referenceable anchor (the code object,
a compiler object) that dies drops the key and its tree, so a different
object that later gets the same id() cannot find it; an anchor that cannot be
weakly referenced (a list in a closure) is held strongly until ``reset()``.
So a lambda's cache outlives the lambda, as long as its code does (for a
lambda in a function, the function's code), which is what a loop that remakes
it needs; a compiler object's cache dies with the object, as before.

A compiler made anew with an anchor that is a new object each time (a lambda
closing over a list made in the loop) still gets a new key, and so captures
and compiles every graph again. When such a key captures for the first time
while another key with the same fingerprint shape (equal but for anchors)
has captured before, alive or dropped recently, ca_runtime warns once per
code object (``RecompileWarning``), naming the closure value that differs.

The weakref callbacks only touch this module's registry under its lock and
call ``ca_core.drop_cache_root``, which is safe from anywhere (see
[Note: What the cache lets go of] in ca_core). At exit the registry is
emptied first, so no callback runs while the interpreter is finalised.
"""

from __future__ import annotations

import enum
import functools
import itertools
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import ca_core
import torch

from ca_runtime._log import RecompileWarning, warn_at_user_line
from ca_runtime._torch_interop import dynamo_context_backend

__all__ = ["compiler_key", "compiler_name", "forget_captures", "forget_compiler_keys", "note_first_capture"]

_SIMPLE_TYPES: tuple[type, ...] = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
)
#: Containers longer than this are anchors (compared by identity).
_MAX_ITEMS = 32
#: Nesting deeper than this is an anchor too.
_MAX_DEPTH = 8
#: Dropped keys remembered for the warning (by shape).
_REMEMBERED_DEAD = 64


@dataclass
class _Fingerprint:
    """A compiler's fingerprint while it is being computed."""

    #: Objects compared by identity, in the order met.
    anchors: list[object] = field(default_factory=list)
    #: Per anchor: where it was met ("closure variable 'calls'").
    anchor_paths: list[str] = field(default_factory=list)
    #: Functions being fingerprinted (a cycle back to one is compared by position).
    stack: list[int] = field(default_factory=list)

    def value(self, obj: object, path: str, depth: int = 0) -> Hashable:
        if isinstance(obj, _SIMPLE_TYPES):
            return ("v", type(obj), obj)
        if id(obj) in self.stack:
            return ("cycle", self.stack.index(id(obj)))
        if depth < _MAX_DEPTH:
            if (
                isinstance(obj, (tuple, frozenset))
                and type(obj) in (tuple, frozenset)
                and len(obj) <= _MAX_ITEMS
            ):
                items: list[object] = sorted(obj, key=repr) if isinstance(obj, frozenset) else list(obj)
                return (
                    type(obj),
                    tuple(self.value(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(items)),
                )
            if isinstance(obj, types.FunctionType):
                return self.function(obj, path, depth)
            if isinstance(obj, functools.partial):
                keywords = tuple(sorted(obj.keywords.items()))
                return (
                    "partial",
                    self.value(obj.func, f"{path}.func", depth + 1),
                    self.value(obj.args, f"{path}.args", depth + 1),
                    self.value(keywords, f"{path}.keywords", depth + 1),
                )
            context = dynamo_context_backend(obj)
            if context is not None:  # torch.compile's context, remade per call by config.compiled_autograd
                backend, dynamic = context
                return (
                    "torch.compile",
                    self.value(backend, f"{path} backend", depth + 1),
                    self.value(dynamic, f"{path} dynamic", depth + 1),
                )
            if isinstance(obj, types.MethodType):
                return (
                    "method",
                    self.value(obj.__func__, path, depth + 1),
                    self.anchor(obj.__self__, f"{path}.__self__"),
                )
        return self.anchor(obj, path)

    def function(self, fn: types.FunctionType, path: str, depth: int) -> Hashable:
        self.stack.append(id(fn))
        try:
            code = fn.__code__
            cells = fn.__closure__ or ()
            closure: list[Hashable] = []
            for name, cell in zip(code.co_freevars, cells):
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    closure.append(("empty",))
                    continue
                where = f"closure variable {name!r}" if depth == 0 else f"{path} -> {name!r}"
                closure.append(self.value(contents, where, depth + 1))
            kwdefaults = tuple(sorted((fn.__kwdefaults__ or {}).items()))
            return (
                "function",
                self.anchor(code, f"{path}.__code__", in_shape=True),
                self.value(fn.__defaults__ or (), f"{path} defaults", depth + 1),
                self.value(kwdefaults, f"{path} keyword defaults", depth + 1),
                tuple(closure),
            )
        finally:
            self.stack.pop()

    def anchor(self, obj: object, path: str, in_shape: bool = False) -> Hashable:
        """``obj`` compared by identity; ``in_shape``: its identity is part of the shape too (code)."""
        self.anchors.append(obj)
        self.anchor_paths.append(path)
        return ("code" if in_shape else "anchor", id(obj))


@dataclass
class _KeyRecord:
    """A compiler key in use: what keeps it alive and what the warning needs."""

    key: str
    fingerprint: Hashable
    #: The fingerprint with every anchor replaced by its type name.
    shape: Hashable
    #: The code of the compiler, if it is a function (the warning is once per code).
    code_name: str
    #: Weak references (with _on_anchor_death) or the anchors themselves.
    holds: list[object]
    #: id() of each anchor and where it was met, in fingerprint order.
    anchor_ids: list[int]
    anchor_paths: list[str]
    anchor_types: list[str]
    captured: bool = False


_lock = threading.RLock()  # a weakref callback may fire while this thread holds it
_by_fingerprint: dict[Hashable, _KeyRecord] = {}
_by_key: dict[str, _KeyRecord] = {}
#: Keys dropped recently that had captured, by shape: their anchors' ids.
_dead_shapes: OrderedDict[Hashable, _KeyRecord] = OrderedDict()
#: Code names already warned about.
_warned: set[str] = set()
_numbers = itertools.count(1)


def _shape_of(fingerprint: Hashable, anchor_types: list[str]) -> Hashable:
    """The fingerprint with anchors' ids replaced by their types (in order); code stays itself."""
    types_left = iter(anchor_types)

    def walk(node: Any) -> Any:
        if isinstance(node, tuple):
            if len(node) == 2 and node[0] in ("anchor", "code"):
                kind = next(types_left)
                return node if node[0] == "code" else ("anchor", kind)
            return tuple(walk(x) for x in node)
        return node

    return walk(fingerprint)


def compiler_name(compiler_fn: object) -> str:
    """A callable compiler_fn in messages: its qualified name and where it is defined."""
    fn = compiler_fn
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        code = fn.__code__
        return f"{fn.__qualname__} ({code.co_filename}:{code.co_firstlineno})"
    return f"{type(compiler_fn).__qualname__} object"


def compiler_key(compiler_fn: object, compile_in_background: bool = False) -> str:
    """The cache ``compiler_fn`` uses; see [Note: Compilers made anew]."""
    if isinstance(compiler_fn, str):
        return f"backend:{compiler_fn}" + ("+background" if compile_in_background else "")
    fp = _Fingerprint()
    fingerprint = fp.value(compiler_fn, "compiler_fn")
    with _lock:
        record = _by_fingerprint.get(fingerprint)
        if record is not None:
            return record.key
        anchor_types = [type(a).__qualname__ for a in fp.anchors]
        record = _KeyRecord(
            key=f"callable:{next(_numbers)}",
            fingerprint=fingerprint,
            shape=_shape_of(fingerprint, anchor_types),
            code_name=compiler_name(compiler_fn),
            holds=[],
            anchor_ids=[id(a) for a in fp.anchors],
            anchor_paths=fp.anchor_paths,
            anchor_types=anchor_types,
        )
        callback = functools.partial(_on_anchor_death, record.key)
        for anchor in fp.anchors:
            try:
                record.holds.append(weakref.ref(anchor, callback))
            except TypeError:
                record.holds.append(anchor)
        _by_fingerprint[fingerprint] = record
        _by_key[record.key] = record
        return record.key


def _on_anchor_death(key: str, _ref: object) -> None:
    """An anchor of ``key`` died: the key can never match again; drop its tree."""
    with _lock:
        record = _by_key.pop(key, None)
        if record is None:
            return
        _by_fingerprint.pop(record.fingerprint, None)
        if record.captured:
            _dead_shapes[record.shape] = record
            _dead_shapes.move_to_end(record.shape)
            while len(_dead_shapes) > _REMEMBERED_DEAD:
                _dead_shapes.popitem(last=False)
    ca_core.drop_cache_root(key)


def note_first_capture(key: str) -> None:
    """Called on every capture: warns once per code if ``key`` recompiles what a twin compiled."""
    with _lock:
        record = _by_key.get(key)
        if record is None or record.captured:
            return
        record.captured = True
        if record.code_name in _warned:
            return
        twin = _dead_shapes.get(record.shape)
        if twin is None:
            twin = next(
                (
                    other
                    for other in _by_key.values()
                    if other is not record and other.captured and other.shape == record.shape
                ),
                None,
            )
        if twin is None:
            return
        _warned.add(record.code_name)
        differs = next(
            (
                f"{path} (a new {kind})"
                for path, kind, mine, theirs in zip(
                    record.anchor_paths, record.anchor_types, record.anchor_ids, twin.anchor_ids
                )
                if mine != theirs
            ),
            "a value it captures",
        )
    warn_at_user_line(
        f"ca_runtime: compiler_fn {record.code_name} was made anew, and differs from an earlier one with the "
        f"same code only in {differs}; each such compiler has a cache of its own, so this backward is "
        "captured and compiled again. Create the compiler once, outside the loop, or have it capture values "
        "that compare equal (a backend name, numbers, strings).",
        RecompileWarning,
    )


def forget_captures() -> None:
    """``reset()``: every tree is empty, so no key has captured; the keys themselves stay."""
    with _lock:
        for record in _by_key.values():
            record.captured = False
        _dead_shapes.clear()
        _warned.clear()


def forget_compiler_keys() -> None:
    """Empties the registry (interpreter exit): no weakref callback fires after this."""
    with _lock:
        _by_fingerprint.clear()
        _by_key.clear()
        _dead_shapes.clear()
