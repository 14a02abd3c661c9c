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


def test_grad_of_grad_with_create_graph() -> None:
    x = _leaf(1.0, 2.0)
    (first,) = torch.autograd.grad((x**3).sum(), x, create_graph=True)
    assert first.requires_grad
    assert torch.equal(first, 3 * x.detach() ** 2)
    (second,) = torch.autograd.grad(first.sum(), x)
    assert torch.equal(second, 6 * x.detach())


def test_hessian_vector_product_accumulates_into_grad() -> None:
    x = _leaf(1.0, 2.0)
    vector = torch.tensor([1.0, -1.0])
    (grad,) = torch.autograd.grad((x**3).sum(), x, create_graph=True)
    (grad * vector).sum().backward()
    assert torch.equal(x.grad, 6 * x.detach() * vector)
    assert x.grad.grad_fn is None


def test_backward_with_create_graph_gives_a_differentiable_grad() -> None:
    x = _leaf(1.0, 2.0)
    with warnings.catch_warnings():
        # torch warns about the reference cycle once per process, so the warning itself is not asserted.
        warnings.simplefilter("ignore", UserWarning)
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
        warnings.simplefilter("ignore", UserWarning)  # create_graph's reference-cycle warning
        y.sum().backward(create_graph=True)
    assert seen == [(False, False), (True, False)]
    assert x.grad.requires_grad
