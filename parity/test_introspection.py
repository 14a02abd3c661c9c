"""Introspection of the autograd graph from user code: nodes, names, edges, the current node, warnings."""

from __future__ import annotations

import warnings

import torch
from torch.autograd.graph import Node


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


class Twice(torch.autograd.Function):
    """x * 2; its backward records the name of the node the engine says is running."""

    @staticmethod
    def forward(ctx, x):
        ctx.current_node_names = []
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.current_node_names.append(_current_node_name())
        return grad * 2


class WarnsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        warnings.warn("WarnsInBackward: a warning from the backward", UserWarning, stacklevel=1)
        return grad * 2


def _current_node_name() -> str | None:
    node = torch._C._current_autograd_node()
    return None if node is None else node.name()


def _messages(caught: list[warnings.WarningMessage], text: str) -> list[str]:
    return [str(w.message) for w in caught if text in str(w.message)]


def test_grad_fns_are_autograd_graph_nodes() -> None:
    x = _leaf(1.0, 2.0)
    y = (x * 2).sum()
    custom = Twice.apply(x)
    accumulate = y.grad_fn.next_functions[0][0].next_functions[0][0]
    for node in (y.grad_fn, custom.grad_fn, accumulate):
        assert isinstance(node, Node)
    assert [node.name() for node in (y.grad_fn, custom.grad_fn, accumulate)] == [
        "SumBackward0",
        "TwiceBackward",
        "torch::autograd::AccumulateGrad",
    ]
    assert accumulate.variable is x


def test_next_functions_describe_the_graph() -> None:
    x = _leaf(1.0, 2.0)
    w = _leaf(3.0, 4.0)
    out = (x.exp() * w).sum()

    def describe(node: Node | None) -> object:
        if node is None:
            return None
        return (node.name(), [describe(child) for child, _ in node.next_functions])

    assert describe(out.grad_fn) == (
        "SumBackward0",
        [
            (
                "MulBackward0",
                [
                    ("ExpBackward0", [("torch::autograd::AccumulateGrad", [])]),
                    ("torch::autograd::AccumulateGrad", []),
                ],
            )
        ],
    )


def test_current_autograd_node_in_a_tensor_hook_is_the_node_it_runs_before() -> None:
    seen: list[str | None] = []
    x = _leaf(1.0, 2.0)
    y = x * 2
    y.register_hook(lambda grad: seen.append(_current_node_name()))
    y.sin().sum().backward()
    assert seen == ["MulBackward0"]


def test_current_autograd_node_in_a_custom_functions_backward() -> None:
    x = _leaf(1.0, 2.0)
    y = Twice.apply(x * 1)
    y.sum().backward()
    assert y.grad_fn.current_node_names == ["TwiceBackward"]


def test_node_metadata_set_in_forward_is_read_by_a_hook() -> None:
    seen: list[str] = []
    x = _leaf(1.0, 2.0)
    y = x * 2
    node = y.grad_fn
    node.metadata["layer"] = "first"
    node.register_prehook(lambda grad_outputs: seen.append(node.metadata["layer"]))
    y.sum().backward()
    assert seen == ["first"]


def test_autograd_grad_with_respect_to_a_gradient_edge() -> None:
    x = _leaf(1.0, 2.0)
    hidden = x * 3
    edge = torch.autograd.graph.get_gradient_edge(hidden)
    assert edge.node is hidden.grad_fn
    (grad,) = torch.autograd.grad((hidden * hidden).sum(), edge)
    assert torch.equal(grad, 2 * hidden.detach())


def test_a_warning_from_a_functions_backward_reaches_the_user_once_per_backward() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            WarnsInBackward.apply(_leaf(1.0)).sum().backward()
    assert _messages(caught, "WarnsInBackward") == ["WarnsInBackward: a warning from the backward"] * 2


def test_a_warning_from_a_tensor_hook_reaches_the_user_once() -> None:
    x = _leaf(1.0, 2.0)
    y = x * 2
    y.register_hook(lambda grad: warnings.warn("a warning from a tensor hook", UserWarning, stacklevel=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y.sum().backward()
    assert _messages(caught, "tensor hook") == ["a warning from a tensor hook"]
    assert torch.equal(x.grad, torch.tensor([2.0, 2.0]))


def test_a_warning_from_torch_inside_the_backward_reaches_the_user_once() -> None:
    """A C++ TORCH_WARN raised during the backward (here by an out= op in a hook) becomes one Python warning."""
    x = _leaf(1.0, 2.0)
    y = x * 2

    def triple_into_a_too_small_buffer(grad: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty(1)
        torch.mul(grad, 3, out=buffer)
        return buffer

    y.register_hook(triple_into_a_too_small_buffer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([6.0, 6.0]))
    assert len(_messages(caught, "An output with one or more elements was resized")) == 1


def test_the_profiler_shows_one_range_per_node_with_its_sequence_number() -> None:
    x = _leaf(1.0, 2.0)
    y = x * 2
    z = y.sin()
    loss = z.sum()
    expected = {
        (f"autograd::engine::evaluate_function: {node.name()}", node._sequence_nr())
        for node in (loss.grad_fn, z.grad_fn, y.grad_fn)
    }
    with torch.profiler.profile() as prof:
        loss.backward()
    ranges = {(e.name, e.sequence_nr) for e in prof.events() if e.name.startswith("autograd::engine::")}
    assert expected <= ranges


_CTX_SEEN: list[tuple[bool, str]] = []


class InspectsItsCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        _CTX_SEEN.append((isinstance(ctx, Node), ctx.name()))
        return grad * 2


def test_a_functions_ctx_in_its_backward_is_a_node() -> None:
    _CTX_SEEN.clear()
    for _ in range(2):
        InspectsItsCtx.apply(torch.ones(3, requires_grad=True) * 1.0).sum().backward()
    assert _CTX_SEEN == [(True, "InspectsItsCtxBackward")] * 2
