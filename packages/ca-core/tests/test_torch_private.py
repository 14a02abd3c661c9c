"""Smoke tests of ca_core's private torch dependencies, one per item of csrc/torch_private.h.

A torch upgrade that moves one of them fails here, by name, before any
behaviour test does.
"""

from __future__ import annotations

import pathlib
import re
import warnings

import ca_core
import pytest
import torch
from ca_core import _C


def test_1_py_interpreter_round_trips_a_python_object() -> None:
    obj = object()
    assert _C._private_py_interpreter_roundtrip(obj) is obj


@pytest.mark.parametrize(
    ("value", "kind"),
    [(7, "int"), (2.5, "float"), ([1, -2, 3], "int_list")],
)
def test_2_ivalue_conversions_round_trip(value: object, kind: str) -> None:
    assert _C._private_ivalue_roundtrip(value, kind) == value


def test_2_ivalue_conversions_keep_a_tensor() -> None:
    t = torch.randn(3)
    assert _C._private_ivalue_roundtrip(t, "tensor") is t


class _Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor) -> torch.Tensor:
        return g * 2


def test_3_py_node_is_recognised_by_its_type_name() -> None:
    x = torch.randn(2, requires_grad=True)
    assert _C._private_is_py_node(_Double.apply(x))
    assert not _C._private_is_py_node(x * 3)


def test_9_python_grad_fn_hooks_are_recognised_by_their_type_names() -> None:
    y = torch.randn(2, requires_grad=True) * 3
    assert y.grad_fn is not None
    y.grad_fn.register_prehook(lambda grads: None)
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: None)
    assert _C._private_grad_fn_hooks_are_python(y)


def test_4_hook_without_compiled_args_is_recognised() -> None:
    x = torch.randn(2, requires_grad=True)
    assert _C._private_compiled_args_nyi(x * 3)


def test_5_swap_stash_is_put_back() -> None:
    x = torch.randn(2, requires_grad=True)
    y = x * 3
    assert _C._private_restore_swap_stashes(y, torch.zeros(2))


def test_6_torch_ops_accepts_a_positional_add() -> None:
    from torch._dynamo import compiled_autograd

    assert isinstance(compiled_autograd.ops, compiled_autograd.OpNamespace)
    ops = compiled_autograd.OpNamespace()
    _C._private_add_torch_op(ops, "CaSmokeTest", lambda grads: grads)
    t = torch.ones(1)
    assert ops.CaSmokeTest([t]) == [t]


def test_7_tensor_args_private_maps_are_readable() -> None:
    x = torch.randn(2, requires_grad=True)
    assert _C._private_tensor_args(torch.randn(2), x * 3)


def test_10_a_compiler_call_is_emptied_to_a_fresh_ones_state() -> None:
    x = torch.randn(2, requires_grad=True)
    assert _C._private_clear_compiler_call(torch.randn(2), x * 3)


class _EagerOnly:
    """A runtime for the engine hook that never captures (anomaly mode runs every backward eagerly)."""

    last_failure = ""

    def capture(self, graph: object) -> None:
        return None

    def run_first(self, *args: object) -> None:
        return None

    def report_fallback(self, node: str, reason: str) -> None:
        pass


def test_8_warnings_held_by_the_eager_fallback_are_replayed_once() -> None:
    """A C++ warning raised by a hook on the engine's thread reaches the user once, as in eager."""
    x = torch.randn(3, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        torch.mul(grad, 3, out=torch.empty(1))  # warns: "An output ... was resized"
        return grad

    ca_core.install_engine_hook(_EagerOnly())
    try:
        with warnings.catch_warnings(record=True) as caught, torch.autograd.set_detect_anomaly(True):
            warnings.simplefilter("always")
            y = x * 2
            y.register_hook(hook)
            y.sum().backward()
    finally:
        ca_core.uninstall_engine_hook()
    resized = [w for w in caught if "was resized" in str(w.message)]
    assert len(resized) == 1, [str(w.message) for w in caught]
    assert ca_core.counters()["eager_fallbacks"] >= 1


@pytest.mark.parametrize("create_graph", [False, True])
def test_11_a_graph_tasks_grad_mode_is_readable(create_graph: bool) -> None:
    assert _C._private_task_grad_mode(create_graph) is create_graph


def test_12_hook_registry_signature_changes_with_each_registration_and_removal() -> None:
    x = torch.randn(2, requires_grad=True)
    y = x * 3
    assert _C._private_hook_registry_signature(y) == 0  # no hooks
    first = y.register_hook(lambda g: g)
    one = _C._private_hook_registry_signature(y)
    assert one != 0
    assert _C._private_hook_registry_signature(y) == one  # reading it changes nothing
    first.remove()
    y.register_hook(lambda g: g)  # same number of hooks, a new RemovableHandle id
    assert _C._private_hook_registry_signature(y) not in (0, one)
    for register in (
        lambda: y.grad_fn.register_prehook(lambda go: None),
        lambda: y.grad_fn.register_hook(lambda gi, go: None),
        y.retain_grad,
    ):
        before = _C._private_hook_registry_signature(y)
        register()
        assert _C._private_hook_registry_signature(y) != before
    # A leaf: its grad accumulator's hooks, post-accumulate-grad hooks included.
    leaf_before = _C._private_hook_registry_signature(x)
    handle = x.register_post_accumulate_grad_hook(lambda p: None)
    with_post = _C._private_hook_registry_signature(x)
    assert with_post != leaf_before
    handle.remove()
    assert _C._private_hook_registry_signature(x) != with_post


def test_12_largest_post_hook_id_grows_with_a_registration_only() -> None:
    x = torch.randn(2, requires_grad=True)
    y = x * 3
    assert _C._private_largest_post_hook_id(y) == 0
    y.register_hook(lambda g: g)  # a tensor hook: not a post hook
    y.grad_fn.register_prehook(lambda go: None)
    assert _C._private_largest_post_hook_id(y) == 0
    first = y.grad_fn.register_hook(lambda gi, go: None)
    one = _C._private_largest_post_hook_id(y)
    assert one == first.id
    second = y.grad_fn.register_hook(lambda gi, go: None)
    assert _C._private_largest_post_hook_id(y) == second.id > one
    first.remove()
    assert _C._private_largest_post_hook_id(y) == second.id  # a removal never grows it
    second.remove()
    assert _C._private_largest_post_hook_id(y) == 0
    # A leaf: its post-accumulate-grad hooks.
    handle = x.register_post_accumulate_grad_hook(lambda p: None)
    assert _C._private_largest_post_hook_id(x) == handle.id


def _csrc_includes(csrc: pathlib.Path) -> dict[str, set[str]]:
    """torch/csrc header -> the csrc files (torch_private.* aside) that include it."""
    found: dict[str, set[str]] = {}
    for path in sorted(csrc.glob("*.[ch]*")):
        if path.stem == "torch_private":
            continue
        for header in re.findall(r"#include <(torch/csrc/[\w/]+\.h)>", path.read_text()):
            found.setdefault(header, set()).add(path.name)
    return found


def _audited_includes(header_text: str) -> dict[str, set[str]]:
    """The bullets of torch_private.h's list of torch/csrc headers: header -> the files it names as including it."""
    block = header_text.split("torch/csrc header another file of csrc/ includes is named here", 1)[1]
    block = block.split("The Python side's private uses", 1)[0]
    bullets = re.split(r"\n//   - ", block)[1:]
    audited: dict[str, set[str]] = {}
    for bullet in bullets:
        text = " ".join(line.removeprefix("//").strip() for line in bullet.splitlines())
        files = set(re.split(r",\s*", re.search(r"\(([\w.,\s]+)\)", text).group(1)))  # type: ignore[union-attr]
        for header in re.findall(r"torch/csrc/[\w/]+\.h", text.split("(", 1)[0]):
            audited[header] = files
    return audited


def test_torch_internals_are_included_only_where_torch_private_h_says() -> None:
    """Every torch/csrc header a csrc file includes is in torch_private.h's list, naming exactly the files that do."""
    csrc = pathlib.Path(__file__).resolve().parents[1] / "csrc"
    if not csrc.is_dir():
        pytest.skip(f"the C++ sources are not beside the tests here ({csrc}): run from a source checkout")
    audited = _audited_includes((csrc / "torch_private.h").read_text())
    assert _csrc_includes(csrc) == audited, "list the header, and the files including it, in torch_private.h"


def test_the_include_audit_reads_headers_and_the_files_named() -> None:
    text = (
        "// torch/csrc header another file of csrc/ includes is named here, and why:\n"
        "//   - torch/csrc/a.h, torch/csrc/b/c.h\n//     (x.cpp, y.h): what (not this.h);\n"
        "//   - torch/csrc/d.h (z.cpp): more\n// The Python side's private uses are elsewhere.\n"
    )
    assert _audited_includes(text) == {
        "torch/csrc/a.h": {"x.cpp", "y.h"},
        "torch/csrc/b/c.h": {"x.cpp", "y.h"},
        "torch/csrc/d.h": {"z.cpp"},
    }
