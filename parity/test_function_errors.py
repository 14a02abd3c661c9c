"""Custom autograd.Function misuse: eager's exception type and message, or eager's quiet fix-up.

Also the ctx features whose misuse these tests probe, used correctly
(mark_dirty, mark_non_differentiable, once_differentiable,
set_materialize_grads), so that the errors are told apart from a Function
that merely does not work.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd.function import once_differentiable

FREED = "Trying to backward through the graph a second time"


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


class TooManyGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, grad


class TooFewGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return x * y

    @staticmethod
    def backward(ctx, grad):
        return (grad,)


class GradOfWrongShape(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad[:1]


class GradOfWrongDtype(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return (grad * 2).double()


class GradThatIsNotATensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return "not a tensor"


class GradForANonTensorInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, grad


class NoneGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return x + y

    @staticmethod
    def backward(ctx, grad):
        return None, grad


class SavesANonTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, 3)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Square(torch.autograd.Function):
    """x * x, reading ctx.saved_tensors twice in its backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (first,) = ctx.saved_tensors
        (second,) = ctx.saved_tensors
        return grad * (first + second)


class WritesCtxInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.backward_ran = True
        return grad * 2


class RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("RaisesInBackward refuses to differentiate")


class DoubleInPlace(torch.autograd.Function):
    """x.mul_(2), declared with mark_dirty."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class SortWithIndices(torch.autograd.Function):
    """Sorted values and their (non-differentiable) indices."""

    @staticmethod
    def forward(ctx, x):
        values, indices = x.sort()
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.grads_seen = []
        return values, indices

    @staticmethod
    def backward(ctx, grad_values, grad_indices):
        (indices,) = ctx.saved_tensors
        ctx.grads_seen.append(grad_indices)
        return torch.zeros_like(grad_values).scatter(0, indices, grad_values)


class CubeOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class TwoOutputsNoMaterialize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        ctx.undefined_grads = []
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        ctx.undefined_grads.append((grad_a is None, grad_b is None))
        grad = torch.zeros_like(grad_a if grad_a is not None else grad_b)
        if grad_a is not None:
            grad = grad + 2 * grad_a
        if grad_b is not None:
            grad = grad + 3 * grad_b
        return grad


class DefinesVjp(torch.autograd.Function):
    """``vjp`` is the documented alias of ``backward``."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def vjp(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class DefinesBackwardAndVjp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 3

    @staticmethod
    def vjp(ctx, grad):
        return grad * 2


def test_vjp_is_an_alias_of_backward() -> None:
    x = _leaf(1.0, 2.0)
    for _ in range(2):  # a capture, then a cache hit
        x.grad = None
        DefinesVjp.apply(x * 1.0).sum().backward()
        assert torch.equal(x.grad, torch.tensor([2.0, 4.0]))


def test_defining_both_backward_and_vjp_raises() -> None:
    for _ in range(2):
        with pytest.raises(
            RuntimeError, match="Implementing both 'backward' and 'vjp' for a custom Function"
        ):
            DefinesBackwardAndVjp.apply(_leaf(1.0) * 1.0).sum().backward()


def test_backward_returning_too_many_grads_raises() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"function TooManyGradsBackward returned an incorrect number of gradients \(expected 1, got 2\)",
    ):
        TooManyGrads.apply(_leaf(1.0, 2.0)).sum().backward()


def test_backward_returning_too_few_grads_raises() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"function TooFewGradsBackward returned an incorrect number of gradients \(expected 2, got 1\)",
    ):
        TooFewGrads.apply(_leaf(1.0, 2.0), _leaf(3.0, 4.0)).sum().backward()


def test_backward_returning_a_grad_of_the_wrong_shape_raises() -> None:
    with pytest.raises(
        RuntimeError,
        match=r"Function GradOfWrongShapeBackward returned an invalid gradient at index 0 - "
        r"got \[1\] but expected shape compatible with \[2\]",
    ):
        GradOfWrongShape.apply(_leaf(1.0, 2.0)).sum().backward()


def test_backward_returning_a_grad_of_the_wrong_dtype_is_cast_to_the_inputs_dtype() -> None:
    x = _leaf(1.0, 2.0)
    GradOfWrongDtype.apply(x).sum().backward()
    assert x.grad.dtype == torch.float32
    assert torch.equal(x.grad, torch.tensor([2.0, 2.0]))


def test_backward_returning_a_non_tensor_raises() -> None:
    with pytest.raises(RuntimeError, match=r"expected Variable or None \(got str\)"):
        GradThatIsNotATensor.apply(_leaf(1.0)).sum().backward()


def test_backward_returning_a_grad_for_a_non_tensor_input_raises() -> None:
    with pytest.raises(
        RuntimeError,
        match="function GradForANonTensorInputBackward returned a gradient different than None at position 2, "
        "but the corresponding forward input was not a Variable",
    ):
        GradForANonTensorInput.apply(_leaf(1.0), 2.0).sum().backward()


def test_backward_returning_none_for_an_input_leaves_its_grad_unset() -> None:
    x = _leaf(1.0, 2.0)
    y = _leaf(3.0, 4.0)
    NoneGrad.apply(x, y).sum().backward()
    assert x.grad is None
    assert torch.equal(y.grad, torch.tensor([1.0, 1.0]))


def test_backward_raising_propagates_the_users_exception() -> None:
    x = _leaf(1.0)
    with pytest.raises(ValueError, match="RaisesInBackward refuses to differentiate"):
        RaisesInBackward.apply(x * 3).sum().backward()
    assert x.grad is None


def test_save_for_backward_of_a_non_tensor_raises_in_forward() -> None:
    with pytest.raises(
        TypeError, match="save_for_backward can only save variables, but argument 1 is of type int"
    ):
        SavesANonTensor.apply(_leaf(1.0))


def test_saved_tensors_read_twice_in_backward() -> None:
    x = _leaf(1.0, 2.0)
    Square.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.tensor([2.0, 4.0]))


def test_ctx_attribute_set_in_backward_is_visible_afterwards() -> None:
    x = _leaf(1.0)
    y = WritesCtxInBackward.apply(x * 1)
    y.sum().backward()
    assert y.grad_fn.backward_ran is True
    assert torch.equal(x.grad, torch.tensor([2.0]))


def test_saved_tensors_read_after_backward_raises() -> None:
    x = _leaf(1.0, 2.0)
    y = Square.apply(x * 1)
    y.sum().backward()
    with pytest.raises(RuntimeError, match=FREED):
        y.grad_fn.saved_tensors  # noqa: B018


def test_mark_dirty_in_place_function_on_a_non_leaf() -> None:
    x = _leaf(1.0, 2.0)
    y = x * 3
    version = y._version
    out = DoubleInPlace.apply(y)
    assert out is y and y._version > version
    assert y.grad_fn.name() == "DoubleInPlaceBackward"
    (y * y).sum().backward()
    assert torch.equal(x.grad, 2 * 2 * 3 * (2 * 3 * x.detach()))


def test_mark_non_differentiable_output_gets_no_grad() -> None:
    x = _leaf(3.0, 1.0, 2.0)
    values, indices = SortWithIndices.apply(x)
    assert not indices.requires_grad and values.requires_grad
    (values * torch.tensor([1.0, 10.0, 100.0])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([100.0, 1.0, 10.0]))
    (grad_indices,) = values.grad_fn.grads_seen
    assert grad_indices.dtype == torch.int64 and grad_indices.tolist() == [0, 0, 0]


def test_once_differentiable_double_backward_raises() -> None:
    x = _leaf(1.0, 2.0)
    y = CubeOnce.apply(x)
    (grad,) = torch.autograd.grad((y * x).sum(), x, create_graph=True)
    with pytest.raises(
        RuntimeError,
        match="trying to differentiate twice a function that was marked with @once_differentiable",
    ):
        grad.sum().backward()


def test_set_materialize_grads_false_passes_none_for_an_unused_output() -> None:
    x = _leaf(1.0, 2.0)
    a, b = TwoOutputsNoMaterialize.apply(x)
    b.sum().backward()
    assert a.grad_fn.undefined_grads == [(True, False)]
    assert torch.equal(x.grad, torch.tensor([3.0, 3.0]))
