"""A custom Function's ctx as its backward uses it: attributes deleted, the ctx as a key, writes before a raise."""

from __future__ import annotations

import weakref

import pytest
import torch

_by_ctx: weakref.WeakKeyDictionary[object, float] = weakref.WeakKeyDictionary()


class DeletesWhatForwardSet(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.scale = 3.0
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        scale = ctx.scale
        del ctx.scale
        assert not hasattr(ctx, "scale")
        return grad * scale


class KeyedByItsCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        _by_ctx[ctx] = 4.0
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * _by_ctx[ctx]


class WritesThenRaises(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.seen = True
        raise ValueError("raised by the backward")


def test_del_of_an_attribute_forward_set() -> None:
    x = torch.ones(3, requires_grad=True)
    y = DeletesWhatForwardSet.apply(x * 1.0)
    y.sum().backward()
    assert x.grad.tolist() == [3.0, 3.0, 3.0]
    assert not hasattr(y.grad_fn, "scale")


def test_the_ctx_finds_what_forward_stored_under_it() -> None:
    x = torch.ones(3, requires_grad=True)
    KeyedByItsCtx.apply(x * 1.0).sum().backward()
    assert x.grad.tolist() == [4.0, 4.0, 4.0]


def test_what_a_raising_backward_wrote_stays_on_its_ctx() -> None:
    x = torch.ones(3, requires_grad=True)
    y = WritesThenRaises.apply(x * 1.0)
    with pytest.raises(ValueError, match="raised by the backward"):
        y.sum().backward()
    assert y.grad_fn.seen is True


def test_a_leafs_post_hook_sees_the_tensor_that_became_its_grad() -> None:
    """AccumulateGrad stores the grad it receives as .grad (no copy), and its post hook's input is that tensor."""
    t = torch.ones(3, requires_grad=True)
    acc = t.view_as(t).grad_fn.next_functions[0][0]
    t.register_hook(lambda g: g.sub(2.0))
    acc.register_prehook(lambda go: (go[0].div(5.0),))
    t.register_post_accumulate_grad_hook(lambda p: (p.grad.add_(0.5), None)[1])
    acc.register_hook(lambda gi, go: setattr(t, "grad", go[0].mul(10)))
    (t * 1.0).sum().backward()
    assert torch.allclose(t.grad, torch.full((3,), 3.0))
