"""autograd's documented API surface, one differential program per entry point.

Each program uses one public autograd API the other test files do not reach
(``torch.autograd.functional``, forward-mode AD, ``allow_mutation_on_saved_tensors``,
``disable_saved_tensors_hooks``, ``checkpoint_sequential``, ``generate_vmap_rule``,
``register_multi_grad_hook(mode="any")``, sparse and complex grads, ...),
as a user would write it. It runs twice eagerly and twice inside
``ca_runtime.enable`` (a capture and a cache hit); the values, the ``.grad``
fields and the counters of the real path (graph breaks, fallbacks) are
asserted, so that eager's answer from a silent fallback is no pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from ca_testkit import compare
from torch.autograd import Function
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

pytestmark = pytest.mark.filterwarnings(
    "ignore::ca_runtime.GraphBreakWarning", "ignore::ca_runtime.EagerFallbackWarning"
)


def _leaves(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


class SinWithJvp(Function):
    """sin with setup_context, save_for_forward and a jvp: usable in both AD modes."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.sin()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        (x,) = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return grad * x.cos()

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return tangent * x.cos()


class DoubleInPlace(Function):
    """Doubles its input in place (``mark_dirty``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 2


class ExpWithVmapRule(Function):
    """exp whose vmap rule functorch generates (``generate_vmap_rule=True``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.exp()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return grad * out


def allow_mutation_on_saved_tensors(i: int) -> Any:
    (x,) = _leaves((4,))
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        a = x.clone()
        y = a.sin() * a
        a.mul_(2)  # the saved `a` is cloned before the mutation
        y.sum().backward()
    return x.grad


def disable_saved_tensors_hooks(i: int) -> Any:
    (x,) = _leaves((4,))
    seen = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        with torch.autograd.graph.disable_saved_tensors_hooks("not in this hook"):
            try:
                with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    pass
            except RuntimeError as e:
                seen.append(str(e))
        return grad * 2

    with torch.autograd.graph.disable_saved_tensors_hooks("not in this program"):
        y = x * x
        y.register_hook(hook)
        y.sum().backward()
    return x.grad, seen


def forward_ad_jvp_function(i: int) -> Any:
    (x,) = _leaves((4,))
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.linspace(0.0, 1.0, 4))
        primal, tangent = fwAD.unpack_dual(SinWithJvp.apply(dual) * dual)
        (primal.sum() + tangent.sum()).backward()
    return x.grad, tangent.detach()


def gradcheck_forward_and_backward_ad(i: int) -> Any:
    (x,) = _leaves((3,), dtype=torch.float64)
    return torch.autograd.gradcheck(
        lambda a: SinWithJvp.apply(a) * a, (x,), check_forward_ad=True, check_batched_grad=True
    )


def gradgradcheck(i: int) -> Any:
    (x,) = _leaves((3,), dtype=torch.float64)
    return torch.autograd.gradgradcheck(lambda a: (a.sin() * a).exp(), (x,))


def functional_jacobian(i: int) -> Any:
    (x,) = _leaves((3,))
    f = lambda a: a.sin() * a.sum()
    return (
        torch.autograd.functional.jacobian(f, x),
        torch.autograd.functional.jacobian(f, x, vectorize=True),
    )


def functional_hessian(i: int) -> Any:
    """A grad of a create_graph=True grad with create_graph=True: see [Note: create_graph=True graphs stay differentiable]."""
    (x,) = _leaves((3,))
    f = lambda a: (a.sin() * a).sum()
    return torch.autograd.functional.hessian(f, x), torch.autograd.functional.hvp(f, x, torch.ones(3))[1]


def functional_vjp_jvp(i: int) -> Any:
    (x,) = _leaves((3,))
    f = lambda a: a.exp() * a
    return torch.autograd.functional.vjp(f, x, torch.ones(3))[1], torch.autograd.functional.jvp(
        f, x, torch.ones(3)
    )[1]


def third_derivative(i: int) -> Any:
    (x,) = _leaves((3,))
    (first,) = torch.autograd.grad((x.sin() * x).sum(), x, create_graph=True)
    (second,) = torch.autograd.grad(first.sum(), x, create_graph=True)
    (second * x).sum().backward()
    return first.detach(), second.detach(), x.grad


def checkpoint_sequential_modules(i: int) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
    (x,) = _leaves((2, 4))
    checkpoint_sequential(model, 2, x, use_reentrant=False).sum().backward()
    return x.grad, [p.grad for p in model.parameters()]


def checkpoint_preserving_rng(i: int) -> Any:
    torch.manual_seed(i)
    (x,) = _leaves((64,))
    region = lambda a: torch.nn.functional.dropout(a.sin(), 0.5, True)
    checkpoint(region, x, use_reentrant=False, preserve_rng_state=True).sum().backward()
    return x.grad


def vmap_of_a_generated_vmap_rule(i: int) -> Any:
    (x,) = _leaves((2, 3))
    torch.func.vmap(ExpWithVmapRule.apply)(x).sum().backward()
    return x.grad


def grad_materialize_unused(i: int) -> Any:
    x, unused = _leaves((3,), (3,))
    return torch.autograd.grad((x * 2).sum(), [x, unused], allow_unused=True, materialize_grads=True)


def backward_with_grad_tensors_and_inputs(i: int) -> Any:
    x, w = _leaves((3,), (3,))
    grad_tensors = [torch.ones(3), torch.full((3,), 2.0)]
    torch.autograd.backward([x * w, (x * w).sin()], grad_tensors=grad_tensors, inputs=[w])
    return x.grad, w.grad


def multi_grad_hook_any(i: int) -> Any:
    a, b = _leaves((3,), (3,))
    seen = []
    ya, yb = a * 2, b * 3
    torch.autograd.graph.register_multi_grad_hook((ya, yb), lambda g: seen.append(tuple(g.shape)), mode="any")
    (ya.sum() + yb.sum()).backward()
    return a.grad, b.grad, seen


def sparse_embedding_grads(i: int) -> Any:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    rows = torch.tensor([1, 2, 2, 5])
    embedding(rows).sum().backward()
    embedding(rows).pow(2).sum().backward()  # a sparse grad accumulated onto a sparse .grad
    grad = embedding.weight.grad
    return grad.is_sparse, grad.to_dense()


def complex_grads(i: int) -> Any:
    (x,) = _leaves((3,), dtype=torch.complex64)
    (x * x.conj() + x.sin()).abs().sum().backward()
    return torch.view_as_real(x.grad)


def inference_mode_in_a_hook(i: int) -> Any:
    (x,) = _leaves((3,))
    seen = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            seen.append(float((grad * 2).sum()))
        return grad

    y = x.exp()
    y.register_hook(hook)
    y.sum().backward()
    return x.grad, seen


def multithreading_disabled(i: int) -> Any:
    (x,) = _leaves((3,))
    with torch.autograd.set_multithreading_enabled(False):
        x.exp().sum().backward()
    return x.grad


def mark_dirty_on_a_view(i: int) -> Any:
    (x,) = _leaves((4,))
    a = x.clone()
    DoubleInPlace.apply(a[:2])
    (a * a).sum().backward()
    return x.grad


def saved_tensors_hooks_checkpoint_double_backward(i: int) -> Any:
    """saved-tensor hooks x checkpoint x a custom Function x double backward."""
    (x,) = _leaves((3,))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t):
        y = checkpoint(lambda a: SinWithJvp.apply(a) * a, x, use_reentrant=False)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    g.sum().backward()
    return g.detach(), x.grad


@dataclasses.dataclass(frozen=True)
class Program:
    """One program and what ca's real path does with it (per backend, the same)."""

    step: Callable[[int], Any]
    #: Graph breaks in the two steps' captures (counted once per capture).
    graph_breaks: int = 0
    #: Whole backwards that ran on the eager engine, and why.
    fallbacks: int = 0
    why: str = ""
    #: Why its backwards run eagerly, never captured (see [Note: Which captures wait]), if they do.
    deferred: str = ""


_GRADCHECK_RUNS_EAGERLY = "backwards gradcheck and gradgradcheck run are never captured"

PROGRAMS: dict[str, Program] = {
    p.step.__name__: p
    for p in (
        # The saved `a` is swapped for its clone by the context's pack hook:
        # its unpack runs with its node, behind a break (two nodes saved it).
        Program(allow_mutation_on_saved_tensors, graph_breaks=2),
        Program(disable_saved_tensors_hooks),
        Program(
            forward_ad_jvp_function,
            fallbacks=2,
            why="make_dual's backward node (torch::autograd::Identity) has no compiled_args in torch 2.13",
        ),
        Program(gradcheck_forward_and_backward_ad, deferred=_GRADCHECK_RUNS_EAGERLY),
        Program(gradgradcheck, deferred=_GRADCHECK_RUNS_EAGERLY),
        Program(functional_jacobian),
        Program(functional_hessian),
        Program(functional_vjp_jvp),
        Program(third_derivative),
        Program(checkpoint_sequential_modules),
        Program(checkpoint_preserving_rng),
        # The generated Function runs behind a break; the classes vmap makes
        # per call share one key (see [Note: Generated vmap rules share a key]).
        Program(vmap_of_a_generated_vmap_rule, graph_breaks=1),
        Program(grad_materialize_unused),
        Program(backward_with_grad_tensors_and_inputs),
        Program(multi_grad_hook_any),
        Program(sparse_embedding_grads),
        Program(complex_grads),
        Program(inference_mode_in_a_hook),
        Program(multithreading_disabled),
        Program(mark_dirty_on_a_view),
        # The region's unpack hooks under create_graph=True run with their nodes.
        Program(saved_tensors_hooks_checkpoint_double_backward, graph_breaks=3),
    )
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_documented_api(name: str, backend: str) -> None:
    program = PROGRAMS[name]
    result = compare(
        program.step, backend, steps=2, expect_capture=not (program.fallbacks or program.deferred)
    )
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == program.fallbacks, program.why or result.stats
    assert result.stats["graph_breaks"] == program.graph_breaks, result.stats
    if program.deferred:
        assert result.stats["captures"] == 0 and result.stats["deferred_captures"] > 0, (
            program.deferred,
            result.stats,
        )
    elif not program.fallbacks:
        assert result.stats["cache_hits"] > 0, result.stats  # the second step ran the cached graph


def test_a_create_graph_capture_under_an_aot_backend_compiles_without_aot_autograd() -> None:
    """What [Note: create_graph=True graphs stay differentiable] tells apart, by what compiler_fn returned."""
    from ca_runtime._background import BackgroundInductor
    from ca_runtime._runtime import _once_differentiable

    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    assert _once_differentiable(torch.compile(gm, backend="aot_eager"))
    assert _once_differentiable(torch.compile(gm, backend="inductor"))
    assert _once_differentiable(torch.compile(gm, backend=BackgroundInductor()))
    assert not _once_differentiable(torch.compile(gm, backend="eager"))
    assert not _once_differentiable(gm)
    # A backend of the user's own may call AOTAutograd: taken as one that does.
    assert _once_differentiable(torch.compile(gm, backend=lambda g, _: g))


def test_a_users_compiled_region_stays_once_differentiable(backend: str) -> None:
    """ca's own create_graph graphs differentiate again; a torch.compile'd region of the user's raises eager's error."""
    region = torch.compile(lambda a: (a.sin() * a).sum(), backend="aot_eager")

    def third(i: int) -> Any:
        (x,) = _leaves((3,))
        (first,) = torch.autograd.grad(region(x), x, create_graph=True)
        with pytest.raises(RuntimeError, match="does not currently support double backward"):
            torch.autograd.grad(first.sum(), x, create_graph=True)
        return first.detach()

    result = compare(third, backend, steps=2)
    result.assert_ok()
    # The region's backward behind its one break; the rest captured, then served from the cache.
    assert result.stats["graph_breaks"] == 1 and result.stats["eager_fallbacks"] == 0, result.stats
    assert result.stats["cache_hits"] > 0, result.stats
