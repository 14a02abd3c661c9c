"""Batched grads: ``autograd.grad(is_grads_batched=True)`` and ``torch.func.vmap`` over ``autograd.grad``.

With hooks and checkpointed regions in the graph, and an error raised by a
node's own backward under vmap after a hook ran (the hook runs once).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

GRAD_OUTPUTS = (1.0, -0.5)


def _weight_and_input() -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.tensor([[1.0, -2.0, 0.5], [0.0, 1.5, -1.0], [2.0, 0.25, 1.0]], requires_grad=True)
    x = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]], requires_grad=True)
    return weight, x


@pytest.mark.parametrize("vmap", ["is_grads_batched", "func_vmap"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_batched_grads_with_a_tensor_hook(vmap: str, checkpointed: bool) -> None:
    weight, x = _weight_and_input()
    calls: list[tuple[int, ...]] = []

    def region(a: torch.Tensor) -> torch.Tensor:
        return (a @ weight).tanh() * a

    h = checkpoint(region, x, use_reentrant=False) if checkpointed else region(x)
    h.register_hook(lambda g: calls.append(tuple(g.shape)) or g * 3)
    y = h.sum()
    v = torch.tensor(GRAD_OUTPUTS)
    if vmap == "is_grads_batched":
        gx, gw = torch.autograd.grad(y, (x, weight), v, is_grads_batched=True)
    else:
        gx, gw = torch.func.vmap(lambda u: torch.autograd.grad(y, (x, weight), u, retain_graph=True))(v)
    # The hook sees one unbatched grad per call; vmap batches the call.
    assert calls == [(2, 3)]
    ones_x, ones_w = torch.autograd.grad(region(x).sum() * 3, (x, weight))
    for i, scale in enumerate(GRAD_OUTPUTS):
        torch.testing.assert_close(gx[i], ones_x * scale)
        torch.testing.assert_close(gw[i], ones_w * scale)


def test_a_nodes_error_under_vmap_after_a_hook_ran() -> None:
    """CopySlices's backward on an empty tensor under vmap raises in ATen; the hook before it ran once."""
    x = torch.zeros(0, 4, requires_grad=True)
    c = x * 1.0
    c[:, :2].mul_(x[:, 2:] + 1.0)
    calls: list[tuple[int, ...]] = []
    c.register_hook(lambda g: calls.append(tuple(g.shape)) or g * 2)
    with pytest.raises(RuntimeError, match=r"vmap: Calling Tensor\.as_strided is not supported"):
        torch.autograd.grad(c.sum(), [x], torch.tensor(GRAD_OUTPUTS), is_grads_batched=True)
    assert calls == [(0, 4)]


def test_a_failing_copy_slices_under_vmap_runs_no_unpack_hook() -> None:
    """CopySlices slices its grad before its inner node unpacks the saved tensors: the slicing raises first."""
    log: list[str] = []
    x = torch.zeros(0, 4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: log.append("pack") or t, lambda t: log.append("unpack") or t
    ):
        c = x * 1.0
        c[:, :2].mul_(x[:, 2:] + 1.0)
    with pytest.raises(RuntimeError, match=r"vmap: Calling Tensor\.as_strided is not supported"):
        torch.autograd.grad(c.sum(), [x], torch.tensor(GRAD_OUTPUTS), is_grads_batched=True)
    assert log == ["pack", "pack"]
