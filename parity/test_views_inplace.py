"""Views and in-place ops: CopySlices, version-counter errors, detach_ and ``.data``."""

from __future__ import annotations

import pytest
import torch

MODIFIED_IN_PLACE = (
    "one of the variables needed for gradient computation has been modified by an inplace operation"
)


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, requires_grad=True)


def test_in_place_on_a_view_of_a_non_leaf_rebases_the_graph_on_copy_slices() -> None:
    x = _leaf(1.0, 2.0, 3.0)
    y = x * 1
    y[0].mul_(2)
    assert y.grad_fn.name() == "torch::autograd::CopySlices"
    (y * y).sum().backward()
    assert torch.equal(x.grad, torch.tensor([8.0, 4.0, 6.0]))


def test_in_place_through_a_view_updates_the_bases_grad_and_the_views_grad_fn() -> None:
    x = _leaf(1.0, 2.0, 3.0, 4.0)
    base = x * 1
    view = base.view(2, 2)
    view[:, 1].add_(view[:, 0])  # base[1] += base[0], base[3] += base[2]
    assert base.grad_fn.name() == "torch::autograd::CopySlices"
    (base * torch.tensor([1.0, 10.0, 100.0, 1000.0])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([11.0, 10.0, 1100.0, 1000.0]))


def test_hook_registered_on_the_base_before_an_in_place_on_its_view() -> None:
    """The hook stays with the base's old version: it sees the grad that flowed through exp_."""
    seen: list[torch.Tensor] = []
    x = _leaf(1.0, 2.0)
    base = x * 3
    base.register_hook(lambda grad: seen.append(grad.clone()))
    base[1:].exp_()
    base.sum().backward()
    expected = torch.tensor([1.0, torch.tensor(6.0).exp().item()])
    assert len(seen) == 1 and torch.allclose(seen[0], expected)
    assert torch.allclose(x.grad, 3 * expected)


def test_in_place_on_a_leafs_view_raises() -> None:
    x = _leaf(1.0, 2.0)
    with pytest.raises(
        RuntimeError,
        match="a view of a leaf Variable that requires grad is being used in an in-place operation",
    ):
        x[0].mul_(2)


def test_modifying_a_saved_input_in_place_raises_in_backward() -> None:
    x = _leaf(1.0, 2.0)
    y = x * 2
    out = y.sin()  # saves y
    y.add_(1)
    with pytest.raises(
        RuntimeError,
        match=MODIFIED_IN_PLACE + r": \[torch.FloatTensor \[2\]\], which is output 0 of Add, "
        r"is at version 1; expected version 0 instead",
    ):
        out.sum().backward()


def test_modifying_a_saved_output_in_place_raises_in_backward() -> None:
    x = _leaf(1.0, 2.0)
    out = x.exp()  # saves its result
    out.mul_(2)
    with pytest.raises(
        RuntimeError,
        match=MODIFIED_IN_PLACE + r": \[torch.FloatTensor \[2\]\], which is output 0 of Exp, "
        r"is at version 1; expected version 0 instead",
    ):
        out.sum().backward()


def test_modifying_a_saved_tensor_through_a_view_raises_in_backward() -> None:
    x = _leaf(1.0, 2.0, 3.0)
    y = x * 2
    out = (y * y).sum()
    y[1:].zero_()
    with pytest.raises(RuntimeError, match=MODIFIED_IN_PLACE):
        out.backward()


def test_modifying_through_data_bypasses_the_version_check() -> None:
    x = _leaf(1.0, 2.0)
    y = x * 2
    out = (y * y).sum()
    y.data.mul_(0)
    out.backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 0.0]))


def test_detach_in_place_cuts_the_graph_after_it() -> None:
    x = _leaf(1.0, 2.0)
    kept = x * 3
    cut = x * 5
    cut.detach_()
    assert not cut.requires_grad and cut.grad_fn is None
    (kept * cut).sum().backward()
    assert torch.equal(x.grad, torch.tensor([15.0, 30.0]))
