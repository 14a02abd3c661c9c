"""Anomaly mode: detect_anomaly / set_detect_anomaly naming the node that returned NaN, and its warnings."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled:UserWarning")


def _nan_in_div_backward() -> torch.Tensor:
    """sqrt(x) / x at x = 0: DivBackward0's grad for the divisor x (its output 1) is 0 / 0."""
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    (x.sqrt() / x).sum().backward()
    return x


def _nan_in_sqrt_backward() -> torch.Tensor:
    """sqrt(x) * 0 at x = 0: SqrtBackward0's grad for x (its output 0) is 0 / 0."""
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    (x.sqrt() * 0).sum().backward()
    return x


class NanBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def test_detect_anomaly_names_the_node_that_returned_nan() -> None:
    with (
        torch.autograd.detect_anomaly(),
        pytest.raises(
            RuntimeError, match=r"Function 'SqrtBackward0' returned nan values in its 0th output\."
        ),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", UserWarning)
        _nan_in_sqrt_backward()


def test_set_detect_anomaly_names_the_node_that_returned_nan() -> None:
    with (
        torch.autograd.set_detect_anomaly(True),
        pytest.raises(RuntimeError, match=r"Function 'DivBackward0' returned nan values in its 1th output\."),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", UserWarning)
        _nan_in_div_backward()
    assert not torch.is_anomaly_enabled()


def test_detect_anomaly_warns_with_the_forward_traceback_of_the_failing_node() -> None:
    with (
        torch.autograd.detect_anomaly(),
        pytest.raises(RuntimeError, match="DivBackward0"),
        pytest.warns(UserWarning, match="Error detected in DivBackward0") as caught,
    ):
        _nan_in_div_backward()
    messages = [str(w.message) for w in caught if "Error detected in" in str(w.message)]
    assert len(messages) == 1
    assert "Traceback of forward call that caused the error" in messages[0]


def test_detect_anomaly_names_a_custom_functions_backward() -> None:
    x = torch.tensor([1.0], requires_grad=True)
    with (
        torch.autograd.detect_anomaly(),
        pytest.raises(
            RuntimeError, match=r"Function 'NanBackwardBackward' returned nan values in its 0th output\."
        ),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", UserWarning)
        NanBackward.apply(x).sum().backward()
    assert x.grad is None


def test_detect_anomaly_without_check_nan_lets_nan_through() -> None:
    with torch.autograd.detect_anomaly(check_nan=False):
        x = _nan_in_div_backward()
    assert torch.isnan(x.grad[0]) and x.grad[1].item() == pytest.approx(-0.5)


def test_anomaly_mode_is_visible_inside_a_hook_and_grads_are_exact() -> None:
    seen: list[bool] = []
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    with torch.autograd.detect_anomaly():
        y = x * x
        y.register_hook(lambda grad: seen.append(torch.is_anomaly_enabled()))
        y.sum().backward()
    assert seen == [True]
    assert torch.equal(x.grad, torch.tensor([2.0, 4.0]))
