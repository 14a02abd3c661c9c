"""retain_graph and create_graph: backwards through one graph several times, and grads of grads."""

from __future__ import annotations

import warnings

import pytest
import torch

SECOND_TIME = "Trying to backward through the graph a second time"


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


def test_backward_twice_with_retain_graph_accumulates_twice() -> None:
    x = _leaf(1.0, 2.0)
    loss = (x * x).sin().sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    assert torch.allclose(x.grad, 2 * first)
    assert torch.allclose(first, 2 * x.detach() * (x.detach() ** 2).cos())


def test_second_backward_without_retain_graph_raises() -> None:
    x = _leaf(1.0, 2.0)
    loss = (x * x).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match=SECOND_TIME):
        loss.backward()
    assert torch.equal(x.grad, torch.tensor([2.0, 4.0]))


def test_retained_then_released_graph_raises_on_the_third_backward() -> None:
    x = _leaf(3.0)
    loss = x.exp().sum()
    loss.backward(retain_graph=True)
    loss.backward()
    with pytest.raises(RuntimeError, match=SECOND_TIME):
        loss.backward()
    assert torch.allclose(x.grad, 2 * x.detach().exp())


def test_hooks_run_on_every_backward_of_a_retained_graph() -> None:
    calls: list[str] = []
    x = _leaf(1.0, 2.0)
    y = x * 2
    y.register_hook(lambda grad: calls.append("y"))
    y.grad_fn.register_prehook(lambda grad_outputs: calls.append("prehook"))
    loss = (y * y).sum()
    for _ in range(3):
        loss.backward(retain_graph=True)
    assert calls == ["y", "prehook"] * 3
    assert torch.equal(x.grad, 3 * 8 * x.detach())


def test_autograd_grad_with_retain_graph_twice_leaves_grad_fields_alone() -> None:
    x = _leaf(1.0, 2.0)
    y = _leaf(3.0, 4.0)
    loss = (x * y).pow(2).sum()
    first = torch.autograd.grad(loss, (x, y), retain_graph=True)
    second = torch.autograd.grad(loss, (x, y))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert torch.equal(first[0], 2 * x.detach() * y.detach() ** 2)
    assert x.grad is None and y.grad is None
    with pytest.raises(RuntimeError, match=SECOND_TIME):
        torch.autograd.grad(loss, (x,))


def test_autograd_grad_of_an_unused_input_raises_unless_allowed() -> None:
    x = _leaf(1.0)
    unused = _leaf(2.0)
    loss = (x * 3).sum()
    with pytest.raises(RuntimeError, match="index 1 appears to not have been used in the graph"):
        torch.autograd.grad(loss, (x, unused), retain_graph=True)
    grads = torch.autograd.grad(loss, (x, unused), allow_unused=True)
    assert torch.equal(grads[0], torch.tensor([3.0])) and grads[1] is None
    grads = torch.autograd.grad((x * 3).sum(), (x, unused), materialize_grads=True)
    assert torch.equal(grads[1], torch.tensor([0.0]))


def test_grad_of_grad_with_create_graph() -> None:
    x = _leaf(1.0, 2.0)
    (first,) = torch.autograd.grad((x**3).sum(), x, create_graph=True)
    assert first.requires_grad
    assert torch.equal(first, 3 * x.detach() ** 2)
    (second,) = torch.autograd.grad(first.sum(), x)
    assert torch.equal(second, 6 * x.detach())


def test_third_derivative_through_three_create_graph_backwards() -> None:
    x = _leaf(2.0)
    grad = x.sin()
    derivatives = []
    for _ in range(3):
        (grad,) = torch.autograd.grad(grad.sum(), x, create_graph=True)
        derivatives.append(grad.item())
    assert derivatives == pytest.approx([x.cos().item(), -x.sin().item(), -x.cos().item()])


def test_hessian_vector_product_accumulates_into_grad() -> None:
    x = _leaf(1.0, 2.0)
    vector = torch.tensor([1.0, -1.0])
    (grad,) = torch.autograd.grad((x**3).sum(), x, create_graph=True)
    (grad * vector).sum().backward()
    assert torch.equal(x.grad, 6 * x.detach() * vector)
    assert x.grad.grad_fn is None


def test_backward_with_create_graph_gives_a_differentiable_grad_and_warns() -> None:
    x = _leaf(1.0, 2.0)
    with pytest.warns(UserWarning, match="create_graph=True will create a reference cycle"):
        (x**3).sum().backward(create_graph=True)
    assert x.grad.requires_grad and x.grad.grad_fn is not None
    (penalty,) = torch.autograd.grad(x.grad.sum(), x)
    assert torch.equal(penalty, 6 * x.detach())


def test_hooks_see_grad_mode_as_create_graph_sets_it() -> None:
    seen: list[tuple[bool, bool]] = []
    x = _leaf(1.0, 2.0)
    y = x * x
    y.register_hook(lambda grad: seen.append((torch.is_grad_enabled(), grad.requires_grad)))
    y.sum().backward(retain_graph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the reference-cycle warning of create_graph
        y.sum().backward(create_graph=True)
    assert seen == [(False, False), (True, False)]
    assert x.grad.requires_grad
