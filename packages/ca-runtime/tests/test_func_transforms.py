"""torch.func and batched grads around a backward, against eager.

``autograd.grad(..., is_grads_batched=True)`` runs the engine under vmap:
the walk sees batched grads, and the graph is captured and served from the
cache like any other. ``torch.func.grad`` (alone or under ``vmap``) computes
its grads through functorch's transforms; no backward reaches ca's engine
hook, and the values are eager's.
"""

from __future__ import annotations

import pytest
import torch
from ca_testkit import compare


def _batched_jacobian(i: int) -> torch.Tensor:
    x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
    y = (x.sin() * x).cumsum(0)
    (jacobian,) = torch.autograd.grad(y, x, torch.eye(4), is_grads_batched=True)
    return jacobian


def test_a_batched_grad_is_captured_and_hit(backend: str) -> None:
    result = compare(_batched_jacobian, backend, steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2, result.stats
    assert result.stats["eager_fallbacks"] == 0


@pytest.mark.parametrize("transform", ["grad", "vmap_grad"])
def test_torch_func_grad_is_eagers_and_leaves_the_engine_hook_alone(backend: str, transform: str) -> None:
    def loss(w: torch.Tensor) -> torch.Tensor:
        return (w.sin() * w).sum()

    def step(i: int) -> torch.Tensor:
        if transform == "grad":
            return torch.func.grad(loss)(torch.linspace(0.5, 1.5, 3))
        return torch.func.vmap(torch.func.grad(loss))(torch.linspace(0.5, 1.5, 6).reshape(2, 3))

    result = compare(step, backend, steps=2, expect_capture=False)
    result.assert_ok()
    assert result.stats["captures"] == 0 and result.stats["eager_fallbacks"] == 0, result.stats
