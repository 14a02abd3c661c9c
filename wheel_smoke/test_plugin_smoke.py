"""A small test file for the installed pytest plugin: ``nox -s wheels`` runs it with ``--ca-wrap=eager``."""

from __future__ import annotations

import torch


def test_a_hooked_backward_matches_eager() -> None:
    x = torch.linspace(-1.0, 1.0, 6, requires_grad=True)
    for _ in range(2):
        x.grad = None
        h = x.sin()
        h.register_hook(lambda g: g * 2)
        (h * h).sum().backward()
        torch.testing.assert_close(x.grad, 4 * x.detach().sin() * x.detach().cos())
