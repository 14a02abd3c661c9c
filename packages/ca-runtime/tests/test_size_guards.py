"""A cache hit must be correct for the sizes and scalars it is served with.

Each case is one op run as a sequence of backwards in one process, changing
the input's sizes (0 and 1 included) and the op's int/float arguments
(negative ones included), so that entries are captured with static sizes,
recaptured with dynamic ones and then hit with values the first capture never
saw. Eager is the oracle for every step; see [Note: Signed dynamic sizes] in
ca_core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ca_runtime
import pytest
import torch
import torch.nn.functional as F
from ca_testkit import compare

Op = Callable[[torch.Tensor, Any], torch.Tensor]


def _conv(x: torch.Tensor, a: tuple[int, int, int]) -> torch.Tensor:
    kernel, stride, padding = a
    weight = torch.randn(3, x.shape[1], kernel, kernel, generator=torch.Generator().manual_seed(kernel))
    return F.conv2d(x, weight.requires_grad_(), None, stride, padding)


#: op name -> (the op of (input, argument), [(input shape, argument), ...]).
SEQUENCES: dict[str, tuple[Op, Sequence[tuple[tuple[int, ...], Any]]]] = {
    # A saved SymInt diagonal goes dynamic, then negative (it once crashed the hit).
    "tril": (lambda x, d: x.tril(d), [((10, 10), 0), ((10, 10), 2), ((10, 5), 0), ((10, 5), -1), ((1, 5), -3), ((0, 4), 1), ((6, 6), -7), ((6, 6), 1)]),
    "triu": (lambda x, d: x.triu(d), [((10, 10), 0), ((10, 10), 2), ((10, 5), 0), ((10, 5), -1), ((1, 5), -3), ((0, 4), 1), ((4, 4), 3)]),
    "diagonal": (lambda x, d: x.diagonal(d), [((5, 5), 0), ((5, 5), 1), ((6, 4), 0), ((6, 4), -2), ((1, 1), 0), ((3, 3), -1), ((4, 4), 2)]),
    "narrow": (lambda x, a: x.narrow(0, *a), [((8, 3), (0, 2)), ((8, 3), (2, 3)), ((9, 3), (1, 0)), ((9, 3), (-3, 2)), ((1, 3), (0, 1)), ((5, 2), (-5, 4))]),
    "select": (lambda x, i: x.select(0, i), [((4, 3), 0), ((4, 3), 2), ((5, 3), -1), ((1, 3), 0), ((6, 2), -6), ((6, 2), 5)]),
    "slice": (lambda x, a: x[a[0] : a[1]], [((8, 3), (0, 4)), ((8, 3), (2, 5)), ((9, 3), (-3, None)), ((1, 3), (0, 1)), ((5, 2), (-4, -1)), ((5, 2), (3, 3))]),
    "roll": (lambda x, k: x.roll(k, 0), [((6, 3), 1), ((6, 3), 2), ((7, 3), -1), ((1, 3), 5), ((4, 2), -9), ((0, 2), 1)]),
    "unfold": (lambda x, a: x.unfold(0, *a), [((10,), (3, 1)), ((10,), (3, 2)), ((12,), (4, 3)), ((5,), (5, 1)), ((7,), (1, 1)), ((6,), (2, 4))]),
    "as_strided": (lambda x, a: x.as_strided(*a), [((10,), ((3, 3), (1, 1), 0)), ((10,), ((2, 4), (2, 1), 1)), ((12,), ((2, 2), (3, 1), 2)), ((5,), ((1, 1), (1, 1), 4)), ((6,), ((0,), (1,), 0))]),
    "topk": (lambda x, k: x.topk(k, dim=-1).values, [((4, 6), 2), ((4, 6), 3), ((3, 5), 1), ((3, 5), 5), ((2, 1), 1), ((0, 3), 2)]),
    "repeat": (lambda x, r: x.repeat(*r), [((2, 3), (2, 1)), ((2, 3), (3, 2)), ((4, 1), (1, 5)), ((1, 1), (1, 1)), ((3, 2), (0, 2))]),
    "expand": (lambda x, e: x.expand(*e), [((1, 3), (4, 3)), ((1, 3), (5, 3)), ((2, 1), (2, 7)), ((1, 1), (1, 1)), ((1, 2), (0, 2)), ((3, 1), (-1, 4))]),
    "view": (lambda x, v: x.view(*v), [((4, 3), (12,)), ((4, 3), (2, 6)), ((5, 3), (-1, 5)), ((1, 1), (1,)), ((0, 3), (3, 0))]),
    "cumsum": (lambda x, d: x.cumsum(d), [((4, 3), 0), ((4, 3), 1), ((5, 2), -1), ((1, 1), 0), ((3, 4), -2)]),
    "max_pool2d": (lambda x, a: F.max_pool2d(x, *a), [((1, 2, 8, 8), (2, 2, 0)), ((1, 2, 8, 8), (3, 1, 1)), ((2, 1, 9, 7), (2, 2, 1)), ((1, 1, 4, 4), (4, 1, 0)), ((1, 1, 5, 5), (1, 1, 0))]),
    "avg_pool2d": (lambda x, a: F.avg_pool2d(x, *a), [((1, 2, 8, 8), (2, 2, 0)), ((1, 2, 8, 8), (3, 1, 1)), ((2, 1, 9, 7), (2, 2, 1)), ((1, 1, 4, 4), (4, 1, 0)), ((1, 1, 5, 5), (1, 1, 0))]),
    "conv2d": (_conv, [((1, 2, 8, 8), (3, 1, 0)), ((1, 2, 8, 8), (3, 2, 1)), ((2, 2, 9, 7), (1, 1, 0)), ((1, 2, 5, 5), (5, 1, 2)), ((1, 2, 6, 6), (2, 3, 0))]),
    "interpolate_nearest": (lambda x, s: F.interpolate(x, scale_factor=s, mode="nearest"), [((1, 1, 4, 4), 2.0), ((1, 1, 4, 4), 1.5), ((1, 2, 5, 3), 2.0), ((1, 1, 2, 2), 0.5), ((1, 1, 6, 6), 3.0)]),
    # No symbolic meta for its backward in torch 2.13: see [Note: Static when dynamic fails].
    "interpolate_bilinear": (lambda x, s: F.interpolate(x, scale_factor=s, mode="bilinear"), [((1, 1, 4, 4), 2.0), ((1, 1, 4, 4), 1.5), ((1, 2, 5, 3), 2.0), ((1, 1, 2, 2), 0.5), ((1, 2, 5, 3), 2.0)]),
    "mul_scalar": (lambda x, c: x * c, [((3,), 2.0), ((3,), -1.5), ((4,), 0.0), ((1,), 1.0), ((0,), 3.0)]),
    "pow_scalar": (lambda x, c: (x.abs() + 0.1).pow(c), [((3,), 2.0), ((3,), 3.0), ((4,), -1.0), ((1,), 0.5), ((2,), 0.0)]),
}  # fmt: skip


def _sequence_step(op: Op, steps: Sequence[tuple[tuple[int, ...], Any]]) -> Callable[[int], Any]:
    """Step i of the sequence: fresh input of step i's shape, grad of the op's output."""

    def step(i: int) -> Any:
        shape, arg = steps[i]
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(i)).requires_grad_()
        out = op(x, arg)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + i))
        return torch.autograd.grad(out, [x], grad_out, allow_unused=True)

    return step


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_sizes_and_scalars_change_between_backwards(backend: str, name: str) -> None:
    op, steps = SEQUENCES[name]
    result = compare(_sequence_step(op, steps), backend, steps=len(steps))
    assert result.ok, result.report()
    assert result.stats["captures"] >= 1
    assert result.stats["eager_fallbacks"] == 0
    # Every backward was served compiled (a retry with static sizes is a second capture).
    assert result.stats["captures"] + result.stats["cache_hits"] >= len(steps)


def test_negative_scalar_on_a_dynamic_size_is_a_correct_hit(backend: str) -> None:
    """The 4th backward hits the dynamic entry with diagonal -1 (it once crashed)."""
    steps = [((10, 10), 0), ((10, 10), 2), ((10, 5), 0), ((10, 5), -1), ((10, 5), 3), ((10, 5), -4)]
    result = compare(_sequence_step(lambda x, d: x.tril(d), steps), backend, steps=len(steps))
    assert result.ok, result.report()
    assert result.stats["eager_fallbacks"] == 0
    # Captured once static and once per newly changed size; every later step,
    # negative diagonals included, is a hit.
    assert result.stats["cache_hits"] >= 3, result.stats


def test_graph_that_cannot_be_dynamic_is_recaptured_static(backend: str) -> None:
    """See [Note: Static when dynamic fails]: no fallback, and the last step (a size seen before) still compiles."""
    op, steps = SEQUENCES["interpolate_bilinear"]
    result = compare(_sequence_step(op, steps), backend, steps=len(steps))
    assert result.ok, result.report()
    assert result.stats["eager_fallbacks"] == 0
    entries = ca_runtime.cache_info()
    assert entries and all(not e.failed and e.dynamic_sizes == 0 for e in entries), entries


def test_a_failed_static_recapture_warns_once() -> None:
    """See [Note: Static when dynamic fails]: the dynamic graph's first run fails, then the static capture's compiler."""
    calls: list[int] = []

    def compiler(gm: torch.fx.GraphModule) -> Callable[..., Any]:
        calls.append(len(calls))
        if len(calls) == 1:
            return gm  # the first, static capture works
        if len(calls) == 2:

            def first_run_fails(*args: Any) -> Any:
                raise RuntimeError("the dynamic graph's first run fails")

            return first_run_fails
        raise RuntimeError("the static recapture's compiler fails")

    def step(i: int) -> torch.Tensor:
        x = torch.linspace(0.0, 1.0, 4 + i, requires_grad=True)
        (x * 2).sin().sum().backward()
        assert x.grad is not None
        return x.grad

    with pytest.warns(ca_runtime.EagerFallbackWarning) as caught:
        result = compare(step, compiler, steps=2)
    result.assert_ok()
    assert len(calls) == 3
    fallbacks = [w for w in caught if issubclass(w.category, ca_runtime.EagerFallbackWarning)]
    expected = (
        "ca_runtime: compiler_fn cannot be compiled (RuntimeError: the static recapture's compiler fails); "
        "this backward runs on the eager engine"
    )
    assert [str(w.message) for w in fallbacks] == [expected]
    assert result.stats["captures"] == 2 and result.stats["eager_fallbacks"] == 1
    (entry,) = [e for e in ca_runtime.cache_info() if e.failed]
    assert entry.failure == "compiler_fn: RuntimeError: the static recapture's compiler fails"
