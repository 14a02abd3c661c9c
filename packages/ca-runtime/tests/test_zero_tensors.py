"""Efficient ZeroTensors never reach a compiled graph; see [Note: ZeroTensors kept out of compiled graphs].

Some derivative formulas return ``at::_efficientzerotensor`` (a tensor with no
storage that eager's kernels never read): abs's second derivative does. One
that a node returned inside Inductor's graph, or that was saved and lifted as
a graph input, made Inductor's kernels read address 0. Each program below
runs twice eagerly and twice under ca (a capture and a cache hit) and is
compared with eager; under eager/aot_eager a checking backend also asserts
that no graph Dynamo compiles is ever called with a ZeroTensor, and the
marked test runs the programs under Inductor itself (they segfaulted there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import ca_runtime
import pytest
import torch
from ca_testkit import compare

pytestmark = pytest.mark.filterwarnings(
    "ignore::ca_runtime.GraphBreakWarning", "ignore::ca_runtime.EagerFallbackWarning"
)


def _leaves(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen).requires_grad_() for s in shapes]


def _zero_second_derivative(x: torch.Tensor) -> torch.Tensor:
    """d²|x|/dx², which eager autograd returns as an efficient ZeroTensor (ca's backward: real zeros)."""
    with ca_runtime.disable():
        (first,) = torch.autograd.grad(x.abs().sum(), x, create_graph=True)
        (second,) = torch.autograd.grad(first.sum(), x, create_graph=True)
    assert second._is_zerotensor()  # what the program is about
    return second


def saved_zero_tensor(i: int) -> Any:
    """A ZeroTensor kept from autograd.grad and saved by a later forward (lifted as a graph input)."""
    x, y = _leaves((3, 4), (3, 4))
    zero = _zero_second_derivative(x)
    ((zero * y).sin().sum() + (y * y).sum()).backward()
    return y.grad


def saved_zero_tensor_under_create_graph(i: int) -> Any:
    """``zero * y`` is a ZeroTensor that requires grad; a create_graph backward saves it and differentiates again."""
    x, y = _leaves((3, 4), (3, 4))
    product = _zero_second_derivative(x) * y
    assert product._is_zerotensor() and product.requires_grad
    (grad_y,) = torch.autograd.grad((product.sin() * y).sum() + (y**3).sum(), y, create_graph=True)
    grad_y.pow(2).sum().backward()
    return grad_y.detach(), y.grad


def double_backward_through_abs_with_save_on_cpu(i: int) -> Any:
    """A node's output grad is a ZeroTensor inside the graph (found by the fuzzer, seed 4641)."""
    w, a = _leaves((4, 4), (3, 4))
    b = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.save_on_cpu():
        t = ((a * b).sin() @ w).relu() + a
        root = (t.abs() + 1.0).pow(2.5)
    grads = torch.autograd.grad(root.sum(), [a, w], create_graph=True)
    torch.autograd.backward([(g * g).sum() for g in grads])
    return a.grad, w.grad


def _sign_of(x: torch.Tensor) -> torch.Tensor:
    """d|x|/dx as a differentiable tensor: its own derivative is eager's efficient ZeroTensor."""
    (sign,) = torch.autograd.grad(x.abs().sum(), x, create_graph=True)
    return sign


def leaf_accumulates_a_zero_tensor(i: int) -> Any:
    """The only grad a leaf gets is a ZeroTensor, on a first backward and added to an existing .grad."""
    x, y = _leaves((3,), (3,))
    _sign_of(x).sum().backward()
    first = x.grad.clone()
    ((y * y).sum() + _sign_of(y).sum()).backward()
    return first, y.grad


def hook_on_a_leaf_that_gets_a_zero_tensor(i: int) -> Any:
    """Tensor and post-accumulate-grad hooks of a leaf whose grad is a ZeroTensor (they return a new grad, read it)."""
    x, w = _leaves((3,), (3,))
    seen: list[torch.Tensor] = []
    x.register_hook(lambda g: g + w.detach())
    w.register_hook(lambda g: seen.append(g.clone()))
    w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    (_sign_of(x).sum() + _sign_of(w).sum()).backward()
    return x.grad, w.grad, seen


@dataclasses.dataclass(frozen=True)
class Program:
    step: Callable[[int], Any]
    #: Graph breaks in the captures of the two steps (the same per backend).
    graph_breaks: int = 0


PROGRAMS: dict[str, Program] = {
    p.step.__name__: p
    for p in (
        Program(saved_zero_tensor),
        Program(saved_zero_tensor_under_create_graph),
        Program(leaf_accumulates_a_zero_tensor),
        Program(hook_on_a_leaf_that_gets_a_zero_tensor),
        # save_on_cpu's unpack hooks run with their nodes, behind breaks.
        Program(double_backward_through_abs_with_save_on_cpu, graph_breaks=11),
    )
}


def _no_zero_tensor_inputs(inner: str) -> Callable[[torch.fx.GraphModule], Any]:
    """A compiler_fn whose Dynamo graphs (resumed ones too) fail when called with a ZeroTensor."""

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        compiled = torch._dynamo.lookup_backend(inner)(gm, example_inputs)

        def run(*args: Any) -> Any:
            flat = args[0] if len(args) == 1 and isinstance(args[0], list) else args
            zeros = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a._is_zerotensor()]
            assert not zeros, f"graph inputs {zeros} are ZeroTensors"
            return compiled(*args)

        return run

    return lambda gm: torch.compile(gm, backend=backend)


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_zero_tensors_stay_out_of_compiled_graphs(name: str, backend: str) -> None:
    program = PROGRAMS[name]
    result = compare(program.step, _no_zero_tensor_inputs(backend), steps=2)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0, result.stats
    assert result.stats["graph_breaks"] == program.graph_breaks, result.stats
    assert result.stats["cache_hits"] > 0, result.stats


@pytest.mark.inductor
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_zero_tensors_under_inductor(name: str) -> None:
    program = PROGRAMS[name]
    result = compare(program.step, "inductor", steps=2, rtol=1e-4, atol=1e-5)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0, result.stats
    assert result.stats["cache_hits"] > 0, result.stats


def test_a_leaf_gets_real_zeros_where_eager_gives_a_zero_tensor() -> None:
    """README's Known differences: the values are eager's, the ZeroTensor flag is not (by design)."""

    def step() -> tuple[torch.Tensor, bool]:
        (x,) = _leaves((3,))
        _sign_of(x).sum().backward()
        return x.grad, x.grad._is_zerotensor()

    eager_grad, eager_is_zero = step()
    with ca_runtime.enable("eager", capture_after=1):
        step()
        before = ca_runtime.stats()
        ca_grad, ca_is_zero = step()
        after = ca_runtime.stats()
    # A cache hit each for the create_graph backward and the one through it.
    assert after["captures"] == before["captures"] and after["cache_hits"] == before["cache_hits"] + 2
    assert torch.equal(ca_grad, eager_grad)
    assert eager_is_zero and not ca_is_zero
