"""How long what a backward uses lives: saved tensors, nodes, a Function's ctx and what it holds, hook closures."""

from __future__ import annotations

import gc
import weakref

import torch

STEPS = 3  # a capture, then cache hits when wrapped


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


class _Marker:
    """An object whose death a weakref can see."""


class SavesAnIntermediate(torch.autograd.Function):
    """Saves a tensor it makes in forward (only the ctx holds it)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x * 3)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (tripled,) = ctx.saved_tensors
        return grad * tripled


class TakesObjects(torch.autograd.Function):
    """Non-tensor inputs and a non-tensor output; keeps an object on its ctx."""

    @staticmethod
    def forward(ctx, x, scale, marker):
        ctx.scale = scale
        ctx.marker = marker
        return x * scale, marker

    @staticmethod
    def backward(ctx, grad, _):
        return grad * ctx.scale, None, None


class DoublesInPlace(torch.autograd.Function):
    """An in-place Function: marks its input dirty and saves it."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        (doubled,) = ctx.saved_tensors  # read, as a backward that uses it would
        return grad * 2 + doubled * 0


def test_a_saved_intermediate_is_freed_by_the_backward() -> None:
    x = _leaf(1.0, 2.0)
    y = x * 2
    out = y.sin().sum()  # SinBackward0 saves y
    y_ref = weakref.ref(y)
    del y
    assert y_ref() is not None
    out.backward()
    assert y_ref() is None


def test_a_saved_intermediate_stays_alive_with_retain_graph() -> None:
    x = _leaf(1.0, 2.0)
    y = x * 2
    out = y.sin().sum()
    y_ref = weakref.ref(y)
    del y
    out.backward(retain_graph=True)
    assert y_ref() is not None
    del out
    gc.collect()
    assert y_ref() is None


def test_graph_nodes_are_freed_with_the_output() -> None:
    x = _leaf(1.0, 2.0)
    hidden = x.exp()
    out = (hidden * 3).sum()
    marker = _Marker()
    hidden.grad_fn.metadata["marker"] = marker
    marker_ref = weakref.ref(marker)
    del marker
    out.backward()
    assert marker_ref() is not None
    del hidden, out
    assert marker_ref() is None


def test_a_functions_saved_tensor_is_freed_by_the_backward_while_its_output_lives() -> None:
    for _ in range(STEPS):
        x = _leaf(1.0, 2.0)
        y = SavesAnIntermediate.apply(x)
        saved_ref = weakref.ref(y.grad_fn.saved_tensors[0])
        assert saved_ref() is not None
        y.sum().backward()
        assert saved_ref() is None, "the Function's saved tensor outlives the backward"
        assert torch.equal(x.grad, torch.tensor([3.0, 6.0]))
        assert y.grad_fn is not None


def test_what_a_functions_ctx_holds_lives_with_the_ctx() -> None:
    """Objects on the ctx are not freed by the backward (eager keeps the node while the output lives)."""
    for _ in range(STEPS):
        x = _leaf(1.0, 2.0)
        marker = _Marker()
        marker_ref = weakref.ref(marker)
        y, _ = TakesObjects.apply(x, 2.0, marker)
        del marker, _
        y.sum().backward()
        assert marker_ref() is not None
        assert torch.equal(x.grad, torch.tensor([2.0, 2.0]))
        del y
        gc.collect()
        assert marker_ref() is None, "the ctx's object outlives the graph"


def test_an_in_place_functions_node_dies_with_its_output() -> None:
    for _ in range(STEPS):
        a = _leaf(1.0, 2.0)
        b = a * 1
        y = DoublesInPlace.apply(b)
        node_ref = weakref.ref(y.grad_fn)
        y.sum().backward()
        assert torch.equal(a.grad, torch.tensor([2.0, 2.0]))
        del y, b
        gc.collect()
        assert node_ref() is None


def test_a_tensor_hooks_closure_is_freed_with_its_graph() -> None:
    for _ in range(STEPS):
        x = _leaf(1.0, 2.0)
        marker = _Marker()
        marker_ref = weakref.ref(marker)
        h = x * 2
        h.register_hook(lambda g, marker=marker: g * 3)
        del marker
        out = h.sum()
        del h
        out.backward()
        assert torch.equal(x.grad, torch.tensor([6.0, 6.0]))
        assert marker_ref() is not None  # the node still holds its hook
        del out
        gc.collect()
        assert marker_ref() is None


def test_the_grads_a_backward_made_are_freed_with_it() -> None:
    """Nothing of the backward keeps an intermediate grad: a hook's weakref to one is dead afterwards."""
    refs: list[weakref.ref[torch.Tensor]] = []
    for _ in range(STEPS):
        x = _leaf(1.0, 2.0)
        h = x.exp()
        h.register_hook(lambda g: refs.append(weakref.ref(g)))
        (h * h).sum().backward()
        del h
        gc.collect()
        assert refs[-1]() is None, "a grad of the backward is still alive"


def test_a_custom_function_ctx_and_its_attributes_are_freed_after_backward() -> None:
    class Cube(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            ctx.payload = torch.zeros(4)
            return x**3

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 3 * x * x * grad

    x = _leaf(1.0, 2.0)
    y = Cube.apply(x * 1)
    ctx_ref = weakref.ref(y.grad_fn)
    payload_ref = weakref.ref(y.grad_fn.payload)
    y.sum().backward()
    del y
    assert ctx_ref() is None, "the ctx is still alive after the backward and the output are gone"
    assert payload_ref() is None, "a tensor held by the ctx is still alive"
    assert torch.equal(x.grad, torch.tensor([3.0, 12.0]))
