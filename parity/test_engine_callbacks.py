"""Engine callbacks: ``Variable._execution_engine.queue_callback`` from hooks, run at the end of the backward."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

ENGINE = torch.autograd.Variable._execution_engine


def _queue(callback: Callable[[], None]) -> None:
    ENGINE.queue_callback(callback)


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


def test_callback_queued_from_a_hook_runs_after_every_hook_and_leaf_grad() -> None:
    calls: list[str] = []
    v = _leaf(1.0, 2.0)
    w = _leaf(3.0, 4.0)
    h = v * 2

    def hook(grad: torch.Tensor) -> None:
        calls.append("h hook")
        _queue(lambda: calls.append(f"callback v.grad={v.grad.tolist()} w.grad={w.grad.tolist()}"))

    h.register_hook(hook)
    v.register_hook(lambda grad: calls.append("v hook"))
    (h * w).sum().backward()
    assert calls == ["h hook", "v hook", "callback v.grad=[6.0, 8.0] w.grad=[2.0, 4.0]"]


def test_callbacks_run_in_queue_order_and_callbacks_queued_by_callbacks_run_too() -> None:
    calls: list[str] = []
    x = _leaf(1.0, 2.0)
    y = x * 2

    def first() -> None:
        calls.append("first")
        _queue(lambda: calls.append("queued by first"))

    def hook(grad: torch.Tensor) -> None:
        _queue(first)
        _queue(lambda: calls.append("second"))

    y.register_hook(hook)
    y.sum().backward()
    assert calls == ["first", "second", "queued by first"]


def test_callbacks_are_per_backward() -> None:
    calls: list[int] = []
    x = _leaf(1.0)
    for step in range(3):
        y = x * 2
        if step != 1:
            y.register_hook(lambda grad, step=step: _queue(lambda: calls.append(step)))
        y.sum().backward()
    assert calls == [0, 2]


def test_callback_queued_from_a_module_backward_hook() -> None:
    """The pattern of FSDP and DDP: a post-backward step after the whole backward."""
    calls: list[str] = []
    torch.manual_seed(0)
    layer = torch.nn.Linear(2, 1)

    def full_hook(module, grad_input, grad_output) -> None:
        calls.append("module hook")

        def finalize() -> None:
            calls.append(f"finalize weight.grad={layer.weight.grad.tolist()}")

        _queue(finalize)

    layer.register_full_backward_hook(full_hook)
    layer(torch.tensor([[1.0, 2.0]], requires_grad=True)).sum().backward()
    assert calls == ["module hook", "finalize weight.grad=[[1.0, 2.0]]"]


def test_callback_queued_from_a_post_accumulate_grad_hook_sees_every_grad() -> None:
    seen: list[tuple[list[float], list[float]]] = []
    a = _leaf(1.0)
    b = _leaf(2.0)
    a.register_post_accumulate_grad_hook(
        lambda leaf: _queue(lambda: seen.append((a.grad.tolist(), b.grad.tolist())))
    )
    (a * b * 3).sum().backward()
    assert seen == [([6.0], [3.0])]


def test_callback_that_raises_propagates_from_backward() -> None:
    x = _leaf(1.0)
    y = x * 2

    def failing_callback() -> None:
        raise ValueError("the callback failed")

    y.register_hook(lambda grad: _queue(failing_callback))
    with pytest.raises(ValueError, match="the callback failed"):
        y.sum().backward()


def test_callback_queued_during_autograd_grad() -> None:
    calls: list[str] = []
    x = _leaf(1.0, 2.0)
    y = x * x
    y.register_hook(lambda grad: _queue(lambda: calls.append("callback")))
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert calls == ["callback"]
    assert torch.equal(grad, torch.tensor([2.0, 4.0])) and x.grad is None
