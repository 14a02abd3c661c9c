"""What a hook may return: eager checks a hook's result and raises TypeError/RuntimeError naming the hook."""

from __future__ import annotations

import re

import pytest
import torch


def _hidden() -> torch.Tensor:
    return torch.ones(2, 3, requires_grad=True) * 2


def _backward(hidden: torch.Tensor) -> None:
    (hidden * hidden).sum().backward()


def test_tensor_hook_returning_another_size() -> None:
    hidden = _hidden()
    hidden.register_hook(lambda g: g[:1])
    with pytest.raises(RuntimeError, match="hook '<lambda>' has changed the size of value"):
        _backward(hidden)


def test_tensor_hook_returning_an_int() -> None:
    hidden = _hidden()
    hidden.register_hook(lambda g: 3)
    with pytest.raises(TypeError, match="expected Variable, but hook returned 'int'"):
        _backward(hidden)


def test_tensor_hook_returning_another_dtype() -> None:
    hidden = _hidden()
    hidden.register_hook(lambda g: g.double())
    with pytest.raises(
        RuntimeError,
        match=r"hook '<lambda>' has changed the type of value \(was torch.FloatTensor got torch.DoubleTensor\)",
    ):
        _backward(hidden)


def test_grad_fn_pre_hook_returning_a_list() -> None:
    hidden = _hidden()
    hidden.grad_fn.register_prehook(lambda go: [go[0] * 2])
    with pytest.raises(TypeError, match="expected tuple, but hook returned 'list'"):
        _backward(hidden)


def test_grad_fn_pre_hook_returning_too_many_values() -> None:
    hidden = _hidden()
    hidden.grad_fn.register_prehook(lambda go: (go[0], go[0]))
    with pytest.raises(
        RuntimeError, match=r"has returned an incorrect number of values \(got 2, but expected 1\)"
    ):
        _backward(hidden)


def test_grad_fn_post_hook_replacing_a_none_grad() -> None:
    hidden = _hidden()
    hidden.grad_fn.register_hook(lambda gi, go: (gi[0], gi[0]))
    with pytest.raises(RuntimeError, match="can't replace a None gradient with a non-None value"):
        _backward(hidden)


def test_grad_fn_post_hook_returning_a_good_tuple_replaces_the_grads() -> None:
    x = torch.ones(2, 3, requires_grad=True)
    hidden = x * 2
    hidden.grad_fn.register_hook(lambda gi, go: (gi[0] * 10, None))
    _backward(hidden)
    assert torch.equal(x.grad, torch.full((2, 3), 80.0))


@pytest.mark.parametrize(
    ("returns", "error", "message"),
    [
        (lambda p: p.grad, RuntimeError, "Tensor post accumulate grad hooks should return None."),
        (lambda p: (p.grad, 1), TypeError, "expected Variable, but hook returned 'tuple'"),
        (lambda p: 1, TypeError, "expected Variable, but hook returned 'int'"),
    ],
    ids=["a-tensor", "a-tuple", "an-int"],
)
def test_post_accumulate_grad_hook_returning_a_value(returns, error, message) -> None:  # type: ignore[no-untyped-def]
    calls: list[str] = []
    leaf = torch.ones(2, 3, requires_grad=True)
    leaf.register_post_accumulate_grad_hook(lambda p: calls.append("hook") or returns(p))
    with pytest.raises(error, match=re.escape(message)):
        (leaf * leaf).sum().backward()
    assert calls == ["hook"]
    assert torch.equal(leaf.grad, torch.full((2, 3), 2.0))  # accumulated before the hook ran
