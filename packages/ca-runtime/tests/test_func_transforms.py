"""torch.func and batched grads around a backward, against eager.

``autograd.grad(..., is_grads_batched=True)`` runs the engine under vmap:
the walk sees batched grads, and the graph is captured and served from the
cache like any other (keyed apart from the same backward outside a vmap,
and run as the captured GraphModule where the compiler is torch.compile:
see [Note: Graphs of a backward inside a vmap]), checkpointed regions included (their recompute under
vmap: see [Note: The recompute under vmap over the engine]). ``torch.func.grad`` (alone or under ``vmap``) computes
its grads through functorch's transforms; no backward reaches ca's engine
hook, and the values are eager's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import ca_runtime
import pytest
import torch
from ca_runtime._report.model import build_report_data
from ca_testkit import compare
from torch.utils.checkpoint import checkpoint


def _batched_jacobian(i: int) -> torch.Tensor:
    x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
    y = (x.sin() * x).cumsum(0)
    (jacobian,) = torch.autograd.grad(y, x, torch.eye(4), is_grads_batched=True)
    return jacobian


def _checkpointed_batched_grads(vmap: str) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """Batched grads through a non-reentrant checkpoint region; see [Note: The recompute under vmap over the engine]."""
    weight = torch.linspace(-1.0, 1.0, 16).reshape(4, 4).requires_grad_()
    x = torch.linspace(0.1, 1.2, 12).reshape(3, 4).requires_grad_()
    grad_outputs = torch.tensor([1.0, -0.5])

    def region(a: torch.Tensor) -> torch.Tensor:
        return (a @ weight).sin() * a

    def step(i: int) -> tuple[torch.Tensor, ...]:
        y = checkpoint(region, x, use_reentrant=False).sum()
        if vmap == "is_grads_batched":  # torch's legacy vmap over the engine
            return torch.autograd.grad(y, (x, weight), grad_outputs, is_grads_batched=True)
        return torch.func.vmap(lambda v: torch.autograd.grad(y, (x, weight), v, retain_graph=True))(
            grad_outputs
        )

    return step


@pytest.mark.parametrize("case", ["jacobian", "checkpoint_is_grads_batched", "checkpoint_func_vmap"])
def test_a_batched_grad_is_captured_and_hit(backend: str, case: str) -> None:
    step = _batched_jacobian if case == "jacobian" else _checkpointed_batched_grads(case.split("_", 1)[1])
    result = compare(step, backend, steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2, result.stats
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0, result.stats


def _counting_compiler(backend: str, graphs: list[int]) -> Callable[[torch.fx.GraphModule], object]:
    """torch.compile with ``backend``, appending each graph Dynamo hands the backend (its node count) to ``graphs``."""

    def counted(gm: torch.fx.GraphModule, example_inputs: list[object]) -> object:
        graphs.append(len(gm.graph.nodes))
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return lambda gm: torch.compile(gm, backend=counted)


@pytest.mark.parametrize("vmap", ["is_grads_batched", "func_vmap"])
def test_a_batched_backward_runs_its_graph_without_dynamo_and_apart_from_the_unbatched_one(
    backend: str, vmap: str, caplog: pytest.LogCaptureFixture
) -> None:
    """See [Note: Graphs of a backward inside a vmap] and [Note: Backwards inside a vmap] in ca_core.

    The same graph alternately inside and outside a vmap: two entries, each
    hit, Dynamo compiling only the unbatched one, nothing logged about fake
    tensors (Dynamo's "meta converter nyi" warnings when it was handed the
    batched one).
    """

    def step(i: int) -> torch.Tensor:
        x = torch.linspace(0.1, 1.0, 4, requires_grad=True)
        y = (x.sin() * x).cumsum(0)
        if i % 2 == 0:
            return torch.autograd.grad(y, x, torch.linspace(1.0, 2.0, 4))[0]
        if vmap == "is_grads_batched":
            return torch.autograd.grad(y, x, torch.eye(4), is_grads_batched=True)[0]
        return torch.func.vmap(lambda v: torch.autograd.grad(y, x, v, retain_graph=True)[0])(torch.eye(4))

    graphs: list[int] = []
    with caplog.at_level("WARNING", logger="torch._dynamo"):
        result = compare(step, _counting_compiler(backend, graphs), steps=4)
    result.assert_ok()
    assert result.stats["captures"] == 2 and result.stats["cache_hits"] == 2, result.stats
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0, result.stats
    assert len(graphs) == 1, graphs  # the unbatched graph's; the batched one never reached Dynamo
    assert not [r for r in caplog.records if "fake tensor" in r.getMessage()]


def test_a_batched_backward_still_calls_a_compiler_fn_that_is_not_torch_compile() -> None:
    """Only ``torch.compile(gm)`` is replaced by the GraphModule: another compiler_fn's result is used as always."""
    seen: list[torch.fx.GraphModule] = []

    def mine(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        seen.append(gm)
        return gm

    result = compare(_batched_jacobian, mine, steps=2)
    result.assert_ok()
    assert len(seen) == 1 and result.stats["cache_hits"] == 1, result.stats
    assert result.stats["captures"] == 1 and result.stats["eager_fallbacks"] == 0, result.stats
    assert result.stats["graph_breaks"] == 0, result.stats


class _ScaledExp(torch.autograd.Function):
    """exp(x) * 1.5 whose vmap rule functorch generates: torch.func.vmap makes a new class of it per call."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.exp() * 1.5

    @staticmethod
    def setup_context(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(output)  # type: ignore[attr-defined]

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (out,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad * out


def _vmapped_function_step(layout: Callable[[int], str]) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """A training step whose forward vmaps _ScaledExp: over dim 0, dim 1 (in_dims=1), or twice (nested)."""

    def step(i: int) -> tuple[torch.Tensor, ...]:
        w = torch.linspace(-0.5, 0.5, 12).reshape(3, 4).requires_grad_()
        x = torch.linspace(0.1, 1.2, 9).reshape(3, 3) @ w
        kind = layout(i)
        if kind == "dim0":
            y = torch.func.vmap(_ScaledExp.apply)(x)
        elif kind == "dim1":
            y = torch.func.vmap(_ScaledExp.apply, in_dims=1, out_dims=1)(x)
        else:  # the two levels are made from equal arguments (in_dims 0, batch 3)
            y = torch.func.vmap(torch.func.vmap(_ScaledExp.apply))(x[:, :3])
        (y.sin() * 2).sum().backward()
        return (w.grad,)

    return step


@pytest.mark.parametrize(
    ("name", "layout", "captures"),
    [
        ("every-step-the-same", lambda i: "dim0", 1),
        ("two-in_dims-alternating", lambda i: ("dim0", "dim1")[i % 2], 2),
        ("nested-equal-levels", lambda i: "nested", 1),
    ],
)
def test_a_function_vmapped_by_its_generated_rule_is_captured_once(
    backend: str, name: str, layout: Callable[[int], str], captures: int
) -> None:
    """See [Note: Generated vmap rules share a key]: the class vmap makes per call does not make a new key per step."""
    result = compare(_vmapped_function_step(layout), backend, steps=4)
    result.assert_ok()
    assert result.stats["captures"] == captures, result.stats
    assert result.stats["cache_hits"] == 4 - captures, result.stats
    assert result.stats["eager_fallbacks"] == 0, result.stats
    assert result.stats["graph_breaks"] == captures, result.stats  # the generated Function's node, per graph


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


def test_a_nodes_own_error_after_a_hook_ran_is_eagers_and_the_hook_runs_once(backend: str) -> None:
    """CopySlices's backward under vmap on an empty tensor raises in ATen, after a tensor hook ran.

    See [Note: User errors are tagged]: judging it by an eager re-run called the hook twice.
    """

    def step(i: int) -> tuple[list[object], tuple[torch.Tensor, ...]]:
        log: list[object] = []
        x = torch.linspace(0.1, 1.2, 0 if i == 0 else 12).reshape(-1, 4).requires_grad_()
        c = x * 1.0
        c[:, :2].mul_(x[:, 2:] + 1.0)
        c.register_hook(lambda g: log.append(tuple(g.shape)) or g * 2)
        try:
            grads = torch.autograd.grad(c.sum(), [x], torch.tensor([1.0, -0.5]), is_grads_batched=True)
        except RuntimeError as e:
            log.append(str(e).splitlines()[0])
            grads = ()
        return log, grads

    result = compare(step, backend, steps=3)
    result.assert_ok()
    # The error left the cache usable: the full-size graph was captured, then hit.
    assert result.stats["captures"] == 2 and result.stats["cache_hits"] == 1, result.stats
    assert result.stats["eager_fallbacks"] == 0, result.stats


def _in_place_on_a_view_under_saved_tensor_hooks(
    rows: int, batched: str, unpack_kind: str
) -> Callable[[int], object]:
    """CopySlices whose inner node's saved tensors have unpack hooks; the step returns grads or eager's error, and the hook log."""

    def step(i: int) -> object:
        log: list[str] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            log.append(f"pack {tuple(t.shape)}")
            return t

        def logged_unpack(tag: str, t: torch.Tensor) -> torch.Tensor:
            log.append(f"unpack {tuple(t.shape)}")
            return t

        # A partial is not inlined by Dynamo: its calls run behind a graph break of ours.
        def unpack(t: torch.Tensor) -> torch.Tensor:
            return logged_unpack("traced", t)

        if unpack_kind == "skipped":
            unpack = functools.partial(logged_unpack, "skipped")
        x = torch.linspace(-1.0, 1.0, rows * 4).reshape(rows, 4).requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            c = x * 1.0
            c[:, :2].mul_(x[:, 2:] + 1.0)
        v = torch.tensor([1.0, -0.5])
        try:
            if batched == "is_grads_batched":
                (grad,) = torch.autograd.grad(c.sum(), x, v, is_grads_batched=True)
            elif batched == "func_vmap":
                (grad,) = torch.func.vmap(lambda u: torch.autograd.grad(c.sum(), x, u, retain_graph=True))(v)
            else:
                (grad,) = torch.autograd.grad(c.sum(), x)
        except RuntimeError as e:
            return str(e)[:60], log
        return grad, log

    return step


def test_copy_slices_failing_under_vmap_runs_no_unpack_hook(backend: str) -> None:
    """Eager's CopySlices slices its grad before its inner node unpacks: on an empty tensor under the legacy vmap the slicing raises first."""
    step = _in_place_on_a_view_under_saved_tensor_hooks(0, "is_grads_batched", "traced")
    with ca_runtime.disable():
        error, log = step(0)
    assert "as_strided is not supported" in error and not any(e.startswith("unpack") for e in log)
    result = compare(step, backend, steps=2, expect_capture=False)
    result.assert_ok()  # the same error and the same hook log, every step
    assert result.stats["eager_fallbacks"] == 0, result.stats


@pytest.mark.parametrize(
    ("batched", "unpack_kind"), [("is_grads_batched", "traced"), ("func_vmap", "traced"), ("none", "skipped")]
)
def test_copy_slices_with_unpack_hooks_runs_as_it_is_behind_its_break(
    backend: str, batched: str, unpack_kind: str
) -> None:
    """Under vmap, or with hooks Dynamo skips, CopySlices runs behind one break and unpacks inside it, as eager does."""
    result = compare(_in_place_on_a_view_under_saved_tensor_hooks(3, batched, unpack_kind), backend, steps=3)
    result.assert_ok()
    stats = result.stats
    assert (stats["captures"], stats["cache_hits"], stats["graph_breaks"]) == (1, 2, 1), stats
    (capture,) = build_report_data().captures
    assert [(b.node_name, b.reason) for b in capture.breaks] == [
        (
            "torch::autograd::CopySlices",
            "its saved tensors' unpack hooks run inside it, after it slices its grad, as in eager",
        )
    ]


def test_copy_slices_with_traced_unpack_hooks_outside_vmap_stays_in_the_graph(backend: str) -> None:
    result = compare(_in_place_on_a_view_under_saved_tensor_hooks(3, "none", "traced"), backend, steps=3)
    result.assert_ok()
    stats = result.stats
    assert (stats["captures"], stats["cache_hits"], stats["graph_breaks"]) == (1, 2, 0), stats
