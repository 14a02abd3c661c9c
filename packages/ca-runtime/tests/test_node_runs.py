"""Runs of nodes in one call and freed saved tensors put back: the graph as Python, against eager.

See [Note: Runs of nodes in one call] and [Note: Freed saved tensors put back]
in ca_core. Every comparison also checks that the fused graph is what
compiler_fn got and, on cache hits, that nodes ran through the put-back path.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import ca_core
import ca_runtime
import ca_testkit
import pytest
import torch
from ca_runtime import _graph_ops as ops
from ca_testkit.scenarios import make_mlp, mlp_step


def _targets(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def _recording(
    compile_with: str | None,
) -> tuple[Callable[[torch.fx.GraphModule], Any], list[torch.fx.GraphModule]]:
    """A compiler_fn that records the graph it gets: torch.compile'd with a backend, or returned as is."""
    seen: list[torch.fx.GraphModule] = []

    def compiler_fn(gm: torch.fx.GraphModule) -> Any:
        seen.append(gm)
        return gm if compile_with is None else torch.compile(gm, backend=compile_with)

    return compiler_fn, seen


def _chain_step(n: int) -> tuple[Callable[[int], torch.Tensor], torch.Tensor]:
    x = torch.randn(16, requires_grad=True)
    factors = [torch.full((16,), 1.0 + k / 100) for k in range(n)]

    def step(i: int) -> torch.Tensor:
        x.grad = None
        y = x * (i + 1)
        for f in factors:
            y = (y * f).sin()
        loss = y.sum()
        loss.backward()
        return loss

    return step, x


def _branching_step() -> tuple[Callable[[int], torch.Tensor], list[torch.Tensor]]:
    """Grads that meet (an accumulate between runs) and a tensor hook in the middle."""
    a = torch.randn(4, 5, requires_grad=True)
    b = torch.randn(5, 3, requires_grad=True)
    calls: list[float] = []

    def step(i: int) -> torch.Tensor:
        a.grad = b.grad = None
        h = (a @ b).tanh()
        h.register_hook(lambda g: calls.append(float(g.sum())) or g * 2)
        loss = (h.exp() + h.sigmoid() * h).mean() * (i + 1)
        loss.backward()
        return loss

    return step, [a, b]


@pytest.fixture(params=["as-is", "eager"])
def python_compiler(request: pytest.FixtureRequest) -> str | None:
    """Where the graph runs as Python: compiler_fn returns it, or Dynamo's eager backend."""
    return None if request.param == "as-is" else "eager"


def test_chain_is_one_call_and_matches_eager(python_compiler: str | None) -> None:
    step, x = _chain_step(30)
    compiler_fn, seen = _recording(python_compiler)
    ca_core.reset_counters()
    result = ca_testkit.compare(step, compiler_fn, tensors=[x], steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    # compiler_fn got one apply_nodes call for the 62 traced nodes...
    assert _targets(seen[0]).count(ops.apply_nodes) == 1
    assert ops.apply_node not in _targets(seen[0])
    # ... while last_graph() keeps one readable call per node.
    last = ca_runtime.last_graph()
    assert last is not None and _targets(last).count(ops.apply_node) >= 61
    # On the first hit every traced node ran eagerly with its freed saved
    # tensors put back; on the second they kept them (see [Note: Nodes that
    # run for real keep their saved tensors] in ca_core).
    assert 60 <= ca_core.counters()["nodes_put_back"] <= 62


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_branching_graph_with_hook_matches_eager(backend: str) -> None:
    step, params = _branching_step()
    compiler_fn, seen = _recording(backend)
    result = ca_testkit.compare(step, compiler_fn, tensors=params, steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    targets = _targets(seen[0])
    # The hook and the accumulations end runs; the runs are still fused.
    assert ops.apply_nodes in targets and ops.call_tensor_hook in targets


def test_mlp_runs_fused_with_every_backend(backend: str) -> None:
    model = make_mlp(sizes=(8, 16, 16, 4))
    compiler_fn, seen = _recording(backend)
    result = ca_testkit.compare(mlp_step(model), compiler_fn, tensors=model, steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["eager_fallbacks"] == 0
    assert ops.apply_nodes in _targets(seen[0])


def test_retain_graph_runs_nodes_as_they_are(python_compiler: str | None) -> None:
    """Nothing is freed early with retain_graph: the nodes keep their own values (no put-back)."""
    x = torch.randn(8, requires_grad=True)
    w = torch.randn(8)

    def step(i: int) -> torch.Tensor:
        x.grad = None
        loss = ((x * w).cos() * (i + 1)).sum()
        loss.backward(retain_graph=True)
        loss.backward()  # the retained graph again: accumulates into x.grad
        return loss

    compiler_fn, _ = _recording(python_compiler)
    ca_core.reset_counters()
    result = ca_testkit.compare(step, compiler_fn, tensors=[x], steps=3)
    result.assert_ok()
    assert result.stats["cache_hits"] >= 4
    # Only the second backward of each step (no retain_graph) frees and puts back.
    assert 0 < ca_core.counters()["nodes_put_back"] <= 2 * 3


def test_backward_twice_after_put_back_raises_eagers_error(python_compiler: str | None) -> None:
    x = torch.randn(8, requires_grad=True)
    compiler_fn, _ = _recording(python_compiler)

    def twice() -> str:
        loss = (x * x.sin()).sum()
        loss.backward()
        with pytest.raises(RuntimeError) as error:
            loss.backward()
        return str(error.value).splitlines()[0]

    eager_error = twice()
    with ca_runtime.enable(compiler_fn, capture_after=1):
        twice()  # the capture
        ca_core.reset_counters()
        ours = twice()  # a hit: the nodes' saved tensors were freed, put back and freed again
        put_back = ca_core.counters()["nodes_put_back"]
        assert put_back > 0, ca_core.counters()
        # Later hits: the nodes keep their saved tensors and release them as they run.
        ours_later = twice()
        assert ca_core.counters()["nodes_put_back"] == put_back
        assert ca_core.counters()["cache_hits"] == 2, ca_core.counters()  # one per twice()
    assert ours == ours_later == eager_error


def _step(node_idx: int, grads: list[int], num_outputs: int) -> ca_core.NodeRunStep:
    """A step without saved tensors, sizes or scalars."""
    return ca_core.NodeRunStep(
        node_idx=node_idx,
        grads=grads,
        saved_tensors=[],
        apply_sizes=-1,
        saved_scalars=-1,
        validate_sizes=-1,
        num_outputs=num_outputs,
    )


def test_node_run_step_is_a_named_type() -> None:
    step = ca_core.NodeRunStep(
        node_idx=3,
        grads=[0, -2],
        saved_tensors=[-1],
        apply_sizes=0,
        saved_scalars=-1,
        validate_sizes=1,
        num_outputs=2,
    )
    assert (step.node_idx, step.grads, step.saved_tensors, step.num_outputs) == (3, [0, -2], [-1], 2)
    assert (step.apply_sizes, step.saved_scalars, step.validate_sizes) == (0, -1, 1)
    with pytest.raises(TypeError):
        ca_core.NodeRunStep(3, [0], [], -1, -1, -1, 1)  # type: ignore[misc]  # keywords only


def test_plan_node_run_rejects_reading_a_later_register() -> None:
    with pytest.raises(ValueError, match="register no earlier node fills"):
        ca_core.plan_node_run([_step(0, [-2], 1)], [-2])
    with pytest.raises(ValueError, match="results must be outputs"):
        ca_core.plan_node_run([_step(0, [0], 1)], [0])


def test_apply_nodes_outside_a_backward_is_a_clear_error() -> None:
    plan = ca_core.plan_node_run([_step(0, [0], 1)], [-2])
    with pytest.raises(RuntimeError, match="no compiled backward is running"):
        ca_core.apply_nodes(plan, [torch.ones(1)], [])
    with pytest.raises(ValueError, match="no plan"):
        ca_core.apply_nodes(plan + 1000, [torch.ones(1)], [])


@pytest.mark.parametrize("python_compiler", [None, "eager", "aot_eager"], ids=["as-is", "eager", "aot_eager"])
def test_a_post_hook_reads_saved_tensors_of_its_node(python_compiler: str | None) -> None:
    """Eager runs grad_fn hooks while the node still holds its saved tensors; so do hits.

    The node is not freed early (``Capture.free_early``), and where it runs
    for real it releases them only after its post hooks (see [Note: Nodes
    that run for real keep their saved tensors] in ca_core).
    """
    x = torch.randn(6, requires_grad=True)
    w = torch.randn(6)
    seen: list[float] = []

    def step(i: int) -> list[float]:
        seen.clear()
        x.grad = None
        y = x * w
        fn = y.grad_fn
        fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(float(fn._saved_other.sum())))
        (y.sin() * (i + 1)).sum().backward()
        return list(seen)

    compiler_fn, _ = _recording(python_compiler)
    result = ca_testkit.compare(step, compiler_fn, tensors=[x], steps=4)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 3, result.stats
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0, result.stats
