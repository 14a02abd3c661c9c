"""Saved tensors: saved_tensors_hooks, save_on_cpu, reading a node's saved tensors, and when unpack hooks run and die."""

from __future__ import annotations

import weakref

import pytest
import torch

FREED = "Trying to backward through the graph a second time"


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


def test_pack_hooks_run_in_forward_and_unpack_hooks_in_backward() -> None:
    calls: list[str] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(f"pack {tensor.tolist()}")
        return tensor

    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(f"unpack {tensor.tolist()}")
        return tensor

    x = _leaf(1.0, 2.0)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = x.sin()
    calls.append("backward")
    y.sum().backward()
    assert calls == ["pack [1.0, 2.0]", "backward", "unpack [1.0, 2.0]"]
    assert torch.allclose(x.grad, x.detach().cos())


def test_unpack_hook_result_is_what_the_backward_uses() -> None:
    x = _leaf(1.0, 2.0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t * 10):
        y = x * x
    y.sum().backward()
    assert torch.equal(x.grad, 2 * 10 * x.detach())


def test_saved_tensors_hooks_on_a_custom_functions_save_for_backward() -> None:
    calls: list[str] = []
    x = _leaf(2.0)
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: calls.append("pack") or t, lambda t: calls.append("unpack") or t
    ):
        y = Cube.apply(x)
    y.sum().backward()
    assert calls == ["pack", "unpack"]
    assert torch.equal(x.grad, torch.tensor([12.0]))


def test_save_on_cpu_gives_eagers_grads() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    x = torch.randn(2, 3)
    model(x).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autograd.graph.save_on_cpu(pin_memory=False):
        out = model(x).sum()
    out.backward()
    assert all(torch.allclose(p.grad, r) for p, r in zip(model.parameters(), reference))


class _Marker:
    """An object hung on a node's metadata: it dies with the node."""


def test_saved_self_is_readable_before_backward_and_raises_after() -> None:
    x = _leaf(1.0, 2.0)
    y = x * 1
    out = y.sin()
    assert torch.equal(out.grad_fn._saved_self, y)
    out.sum().backward()
    with pytest.raises(RuntimeError, match=FREED):
        out.grad_fn._saved_self  # noqa: B018


def test_unpack_hook_after_the_graph_was_freed_is_not_called() -> None:
    unpacked: list[str] = []
    x = _leaf(1.0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: unpacked.append("unpack") or t):
        out = x.cos()
    out.sum().backward()
    with pytest.raises(RuntimeError, match=FREED):
        out.sum().backward()
    assert unpacked == ["unpack"]


def test_unpack_hooks_and_their_closures_are_freed_after_the_backward() -> None:
    """Eager frees a saved tensor's unpack hook with it. Twice: a wrapped run checks the capture and a hit."""
    for _ in range(2):
        marker = _Marker()
        marker_ref = weakref.ref(marker)
        x = _leaf(1.0, 2.0)

        def unpack(t: torch.Tensor, held: _Marker = marker) -> torch.Tensor:
            return t

        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, unpack):
            out = Cube.apply(x.sin()).sum()
        del marker, unpack
        assert marker_ref() is not None  # held with the saved tensor until the backward frees it
        out.backward()
        assert marker_ref() is None, "the unpack hook's closure outlives the backward"


def test_double_backward_through_saved_tensor_hooks_that_copy() -> None:
    """The unpacked copy gets the saved tensor's autograd history back: the double backward flows to x."""
    for _ in range(3):
        x = torch.ones(3, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t):
            y = (x * x * x).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.sum().backward()
        assert torch.equal(x.grad, torch.full((3,), 6.0))


def test_a_hook_reads_another_nodes_saved_tensor_before_that_node_runs() -> None:
    """Eager frees a node's saved tensors once the node has run: a hook on a later tensor may read them."""
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    for _ in range(3):  # the same graph again: a cache hit when wrapped
        x.grad = None
        h = x.sin()
        z = h * 3.0
        seen: list[float] = []
        z.register_hook(lambda g, h=h, seen=seen: seen.append(h.grad_fn._saved_self.sum().item()))
        z.sum().backward()
        assert seen == [6.0]
        assert torch.allclose(x.grad, 3.0 * x.detach().cos())
