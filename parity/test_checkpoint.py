"""Custom Functions inside `torch.utils.checkpoint`: every option, recomputed as eager recomputes them."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    set_checkpoint_early_stop,
)

STEPS = 3  # a capture, then cache hits when wrapped


class Cube(torch.autograd.Function):
    """Saves its input; a plain formula backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


class ScaledByAttribute(torch.autograd.Function):
    """Saves its output and keeps a non-tensor argument on the ctx."""

    @staticmethod
    def forward(ctx, x, scale):
        out = x.exp() * scale
        ctx.save_for_backward(out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * out, None


class NoisyDouble(torch.autograd.Function):
    """Draws random numbers in forward: the recompute must draw the same ones."""

    @staticmethod
    def forward(ctx, x):
        noise = torch.rand_like(x)
        ctx.save_for_backward(noise)
        return x * 2 + noise

    @staticmethod
    def backward(ctx, grad):
        (noise,) = ctx.saved_tensors
        return grad * (2 + noise)


class SetupContextSquare(torch.autograd.Function):
    """The `setup_context` form of a Function."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        (x,) = inputs
        ctx.save_for_backward(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def _expected_cube_of_sin(x: torch.Tensor) -> torch.Tensor:
    return 3 * x.sin() ** 2 * x.cos()


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_a_function_saving_its_input_in_a_checkpoint(preserve_rng_state: bool) -> None:
    for _ in range(STEPS):
        x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
        out = checkpoint(
            lambda a: Cube.apply(a.sin()), x, use_reentrant=False, preserve_rng_state=preserve_rng_state
        )
        out.sum().backward()
        torch.testing.assert_close(x.grad, _expected_cube_of_sin(x.detach()))


def test_a_function_saving_its_output_with_a_ctx_attribute_in_a_checkpoint() -> None:
    for _ in range(STEPS):
        x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
        checkpoint(ScaledByAttribute.apply, x * 2, 0.5, use_reentrant=False).sum().backward()
        torch.testing.assert_close(x.grad, 2 * 0.5 * (2 * x.detach()).exp())


def test_a_function_drawing_random_numbers_recomputes_them() -> None:
    """preserve_rng_state=True: the recompute's noise is the forward's, so the grad is 2 + noise."""
    for step in range(STEPS):
        torch.manual_seed(step)
        x = torch.zeros(5, requires_grad=True)
        out = checkpoint(NoisyDouble.apply, x, use_reentrant=False)
        noise = out.detach().clone()  # x is 0: the output is the noise
        out.sum().backward()
        torch.testing.assert_close(x.grad, 2 + noise, rtol=0, atol=0)


def test_a_setup_context_function_in_a_checkpoint() -> None:
    for _ in range(STEPS):
        x = torch.linspace(-1.0, 1.0, 4, requires_grad=True)
        checkpoint(lambda a: SetupContextSquare.apply(a * 3), x, use_reentrant=False).sum().backward()
        torch.testing.assert_close(x.grad, 18 * x.detach())


def test_nested_checkpoints_around_a_function() -> None:
    def inner(a: torch.Tensor) -> torch.Tensor:
        return Cube.apply(a.sin())

    def outer(a: torch.Tensor) -> torch.Tensor:
        return checkpoint(inner, a * 1.0, use_reentrant=False).cos()

    for _ in range(STEPS):
        x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
        checkpoint(outer, x, use_reentrant=False).sum().backward()
        xd = x.detach()
        expected = -(xd.sin() ** 3).sin() * _expected_cube_of_sin(xd)
        torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("early_stop", [True, False])
def test_checkpoint_early_stop_setting_with_a_function(early_stop: bool) -> None:
    for _ in range(STEPS):
        x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
        with set_checkpoint_early_stop(early_stop):
            out = checkpoint(lambda a: Cube.apply(a.sin()).exp(), x, use_reentrant=False)
        out.sum().backward()
        xd = x.detach()
        torch.testing.assert_close(x.grad, (xd.sin() ** 3).exp() * _expected_cube_of_sin(xd))


@pytest.mark.parametrize("checks", [("none",) * STEPS, ("default", "none", "default", "none")])
def test_checkpoint_without_its_determinism_check(checks: tuple[str, ...]) -> None:
    """ "none" records no metadata of what the region saves, also when the same graph ran with records before.

    (``debug=True`` is left out: its logging tensor's records break pytest's
    log capture in any later test of the process, eager or not.)
    """
    for check in checks:
        x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
        out = checkpoint(lambda a: Cube.apply(a.sin()).exp(), x, use_reentrant=False, determinism_check=check)
        out.sum().backward()
        xd = x.detach()
        torch.testing.assert_close(x.grad, (xd.sin() ** 3).exp() * _expected_cube_of_sin(xd))


def _save_matmuls(ctx, op, *args, **kwargs):
    return (
        CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
    )


def test_selective_checkpoint_context_fn_with_a_function() -> None:
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    w = torch.linspace(-1.0, 1.0, 12).reshape(3, 4).requires_grad_()
    for _ in range(STEPS):
        w.grad = None
        x = torch.linspace(0.1, 1.0, 6).reshape(2, 3)
        out = checkpoint(
            lambda a, b: Cube.apply((a @ b).sin()), x, w, use_reentrant=False, context_fn=context_fn
        )
        out.sum().backward()
        expected = x.t() @ _expected_cube_of_sin(x @ w.detach())
        torch.testing.assert_close(w.grad, expected)


def test_double_backward_through_a_function_in_a_checkpoint() -> None:
    for _ in range(STEPS):
        x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
        out = checkpoint(Cube.apply, x * 1.0, use_reentrant=False).sum()  # its backward is differentiable
        (g,) = torch.autograd.grad(out, x, create_graph=True)
        g.sum().backward()
        torch.testing.assert_close(x.grad, 6 * x.detach())


def test_a_checkpointed_function_under_saved_tensor_hooks() -> None:
    calls: list[str] = []

    def pack(t: torch.Tensor) -> tuple[torch.Tensor]:
        calls.append("pack")
        return (t,)

    def unpack(packed: tuple[torch.Tensor]) -> torch.Tensor:
        calls.append("unpack")
        return packed[0]

    for _ in range(STEPS):
        calls.clear()
        x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = checkpoint(lambda a: Cube.apply(a.sin()), x, use_reentrant=False).exp().sum()
        out.backward()
        xd = x.detach()
        torch.testing.assert_close(x.grad, (xd.sin() ** 3).exp() * _expected_cube_of_sin(xd))
        # Outside the region only: checkpoint's own hooks take over inside it, in forward and recompute.
        assert calls == ["pack", "pack", "unpack", "unpack"]


def test_a_function_run_twice_in_one_region_with_kwargs() -> None:
    def body(a: torch.Tensor, *, scale: float) -> torch.Tensor:
        return Cube.apply(Cube.apply(a) * scale)

    for _ in range(STEPS):
        x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
        checkpoint(body, x, scale=0.5, use_reentrant=False).sum().backward()
        xd = x.detach()
        torch.testing.assert_close(x.grad, 3 * (0.5 * xd**3) ** 2 * 0.5 * 3 * xd**2)
