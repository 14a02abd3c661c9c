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
