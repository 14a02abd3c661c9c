"""Cache semantics: dynamic sizes, explained misses, introspection, robustness."""

from __future__ import annotations

import gc
import logging
import threading
import time
import warnings
import weakref
from typing import Any

import ca_core
import ca_runtime
import pytest
import torch
import torch.utils.checkpoint
from ca_testkit import compare
from ca_testkit.scenarios import make_mlp

BATCH_SWEEP = [4, 8, 16, 32, 8, 64]


def _mlp_batch_step(model: torch.nn.Module, sizes: list[int]):
    def step(i: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(sizes[i], model[0].in_features, generator=gen)
        y = torch.randint(0, model[-1].out_features, (sizes[i],), generator=gen)
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach()

    return step


def test_batch_sweep_at_most_two_captures(backend: str) -> None:
    model = make_mlp()
    result = compare(_mlp_batch_step(model, BATCH_SWEEP), backend, tensors=model, steps=len(BATCH_SWEEP))
    result.assert_ok()
    assert result.stats["captures"] == 2  # static first, then the batch size is dynamic
    assert result.stats["cache_hits"] == len(BATCH_SWEEP) - 2
    (entry,) = ca_runtime.cache_info()
    assert entry.dynamic_sizes > 0 and entry.hits == len(BATCH_SWEEP) - 2


def test_batch_sweep_does_not_recompile_in_dynamo(backend: str) -> None:
    from torch._dynamo.utils import counters

    model = make_mlp()
    counters.clear()
    compare(_mlp_batch_step(model, BATCH_SWEEP), backend, tensors=model, steps=len(BATCH_SWEEP)).assert_ok()
    assert counters["stats"]["unique_graphs"] == 2


def test_sequence_length_changes_on_a_transformer_layer(backend: str) -> None:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True
    )
    lengths = [5, 7, 9, 5, 12]

    def step(i: int) -> None:
        x = torch.randn(2, lengths[i], 16, generator=torch.Generator().manual_seed(i))
        layer.zero_grad(set_to_none=True)
        layer(x).pow(2).mean().backward()

    result = compare(step, backend, tensors=layer, steps=len(lengths))
    result.assert_ok()
    assert result.stats["captures"] <= 2


@pytest.fixture
def miss_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="ca_runtime.misses")
    return caplog


def _misses(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ca_runtime.misses"]


def test_miss_reasons_are_logged(backend: str, miss_log: pytest.LogCaptureFixture) -> None:
    model = make_mlp()
    with ca_runtime.enable(backend, capture_after=1):
        model(torch.randn(4, model[0].in_features)).sum().backward()  # first capture: no line
        assert _misses(miss_log) == []
        model(torch.randn(4, model[0].in_features)).sum().backward()
        (grad_defined,) = _misses(miss_log)
        model(torch.randn(8, model[0].in_features)).sum().backward()
        size_changed = _misses(miss_log)[-1]
        out = model(torch.randn(8, model[0].in_features))
        out.register_hook(lambda g: g)
        out.sum().backward()
        hook_added = _misses(miss_log)[-1]
        model.double()
        model(torch.randn(8, model[0].in_features, dtype=torch.float64)).sum().backward()
        dtype_changed = _misses(miss_log)[-1]
    assert "AccumulateGrad" in grad_defined and ".grad became defined" in grad_defined
    assert "a hook was added to its Python tensor hooks (1 now, 0 in the cached graph)" in hook_added
    assert "Double cpu, was Float cpu" in dtype_changed
    assert "changed from 4 to 8 and is now dynamic" in size_changed and "saved in the forward" in size_changed
    # In the user's words: which node, what changed; no key bytes.
    for line in (grad_defined, size_changed, hook_added, dtype_changed):
        assert "node " in line and "key bytes" not in line and "->" not in line, line
    assert ca_runtime.stats()["captures"] == 5


def test_last_graph_is_readable_code(backend: str) -> None:
    model = make_mlp()
    with ca_runtime.enable(backend, capture_after=1):
        model(torch.randn(4, model[0].in_features)).sum().backward()
    graph = ca_runtime.last_graph()
    code = graph.code
    assert "def forward(self, inputs, sizes, scalars, hooks)" in code
    # Each node's call is named after the autograd node it runs and tagged in meta.
    assert "addmm_backward0 = ca_runtime__graph_ops_apply_node(" in code
    tagged = [(n.name, n.meta["autograd_node"]) for n in graph.graph.nodes if "autograd_node" in n.meta]
    assert ("relu_backward0", "ReluBackward0") in tagged and ("t_backward0", "TBackward0") in tagged
    # ... with the autograd node's sequence number.
    x = torch.randn(4, model[0].in_features)
    with ca_runtime.enable(backend, capture_after=1):
        out = model(x)
        pending, relu_seq = [out.grad_fn], None
        while pending:
            fn = pending.pop()
            if fn.name() == "ReluBackward0":
                relu_seq = fn._sequence_nr()
            pending.extend(f for f, _ in fn.next_functions if f is not None)
        out.sum().backward()
    (relu,) = [
        n for n in ca_runtime.last_graph().graph.nodes if n.meta.get("autograd_node") == "ReluBackward0"
    ]
    assert relu.meta["sequence_nr"] == relu_seq
    # Lifted inputs are read where first used, not in a block at the top.
    body = [line.strip() for line in code.splitlines() if "=" in line]
    assert not body[1].startswith("getitem_1 = inputs[")


def test_create_graph_double_backward(backend: str) -> None:
    x = torch.randn(5, requires_grad=True)

    def step() -> torch.Tensor:
        (grad,) = torch.autograd.grad((x**3).sin().sum(), x, create_graph=True)
        grad.pow(2).sum().backward()
        return grad.detach()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ca_runtime.EagerFallbackWarning)
        compare(step, backend, tensors=[x], steps=2).assert_ok()


def test_double_backward_through_a_checkpoint_when_the_batch_changes(backend: str) -> None:
    """The recomputed activations keep their graph on a recapture with dynamic sizes (fuzzer, combined mode).

    A checkpointed node runs behind a graph break with create_graph=True; on
    the recapture its saved sizes were passed in, which took it off the path
    where its unpacked tensors are attached to their graph: the second-order
    grads lost every term through the recomputed activations.
    """
    w = torch.randn(4, 4, requires_grad=True)

    def region(a: torch.Tensor) -> torch.Tensor:
        return ((a * a).sin() @ w).relu() + a

    def step(i: int) -> list[torch.Tensor]:
        x = torch.randn(
            3 if i % 2 == 0 else 5, 4, generator=torch.Generator().manual_seed(i)
        ).requires_grad_()
        w.grad = None
        out = torch.utils.checkpoint.checkpoint(region, x, use_reentrant=False)
        grads = torch.autograd.grad(out.sum(), [w, x], create_graph=True)
        assert all(g.requires_grad for g in grads)
        sum((g * g).sum() for g in grads).backward()
        return [g.detach() for g in grads] + [x.grad]

    result = compare(step, backend, tensors=[w], steps=3)
    result.assert_ok()
    assert result.stats["captures"] >= 4 and result.stats["graph_breaks"] > 0, result.stats
    assert result.stats["eager_fallbacks"] == 0, result.stats


def test_grad_of_the_same_graph_with_more_inputs_than_it_reaches(backend: str) -> None:
    """See [Note: Outputs no node reaches]: each list of grad() inputs gets the grads eager gives."""
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)  # never reached

    def step(i: int) -> tuple[torch.Tensor | None, ...]:
        inputs = ([a], [a, b], [b, a], [a], [a, b])[i]
        return torch.autograd.grad((a * 2).sin().sum(), inputs, allow_unused=True)

    result = compare(step, backend, steps=5)
    result.assert_ok()
    assert result.stats["captures"] == 3 and result.stats["cache_hits"] == 2, result.stats


def test_retain_graph_repeated_backward(backend: str) -> None:
    x = torch.randn(5, requires_grad=True)

    def step() -> None:
        y = (x.exp() * x).sum()
        y.backward(retain_graph=True)
        y.backward(retain_graph=True)
        y.backward()

    result = compare(step, backend, tensors=[x], steps=2)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0


def test_failing_capture_falls_back_once_and_is_remembered(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ca_runtime import _runtime

    def broken(graph):
        raise RuntimeError("capture bug injected by the test")

    monkeypatch.setattr(_runtime, "build_graph_module", broken)
    model = make_mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compare(
            _mlp_batch_step(model, [4, 4, 4]), backend, tensors=model, steps=3, expect_capture=False
        )
    result.assert_ok()
    fallbacks = [w for w in caught if issubclass(w.category, ca_runtime.EagerFallbackWarning)]
    assert len(fallbacks) == 1 and "capture bug injected" in str(fallbacks[0].message)
    assert result.stats["eager_fallbacks"] == 3


def test_reentrant_backward_inside_a_hook(backend: str) -> None:
    x = torch.randn(4, requires_grad=True)
    inner = torch.randn(4, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            (inner * 3).sum().backward()  # a backward inside a backward
        return grad * 2

    def step() -> None:
        y = x * x
        y.register_hook(hook)
        y.sum().backward()

    compare(step, backend, tensors=[x, inner], steps=2).assert_ok()


def test_two_threads_backward_at_once(backend: str) -> None:
    errors: list[BaseException] = []

    def train(model: torch.nn.Module, seed: int, out: list[list[torch.Tensor]]) -> None:
        try:
            gen = torch.Generator().manual_seed(seed)
            for _ in range(50):
                x = torch.randn(4, model[0].in_features, generator=gen)
                model(x).pow(2).mean().backward()
            out.append([p.grad.clone() for p in model.parameters()])
        except BaseException as e:  # re-raised in the main thread below
            errors.append(e)

    def run(enabled: bool) -> list[list[torch.Tensor]]:
        results: list[list[torch.Tensor]] = [[], []]
        models = [make_mlp(), make_mlp()]
        threads = [threading.Thread(target=train, args=(models[i], i, results[i])) for i in range(2)]
        ctx = ca_runtime.enable(backend, capture_after=1) if enabled else ca_runtime.disable()
        with ctx:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        return [r[0] for r in results]

    eager, compiled = run(False), run(True)
    for want, got in zip(eager, compiled):
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w)
    assert ca_runtime.stats()["cache_hits"] > 0


def test_saved_activations_are_freed_after_backward(backend: str) -> None:
    model = make_mlp()
    with ca_runtime.enable(backend, capture_after=1):
        for _ in range(3):
            hidden = model[1](model[0](torch.randn(4, model[0].in_features)))
            probe = weakref.ref(hidden)
            model[2](hidden).sum().backward()
            del hidden
            gc.collect()
            assert probe() is None, "a saved activation outlived its backward"


def test_thousand_steps_keep_one_entry_and_flat_memory(backend: str) -> None:
    import resource

    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)

    def steps(n: int) -> None:
        for _ in range(n):
            x = torch.randn(8, model[0].in_features, generator=gen)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    with ca_runtime.enable(backend, capture_after=1):
        steps(100)  # warm up: captures, allocator pools
        gc.collect()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        steps(1000)
        gc.collect()
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert len(ca_runtime.cache_info()) == 1
    assert after - before < 20 * 1024, f"max RSS grew by {(after - before) / 1024:.1f} MiB"


def test_cache_info_reports_entries(backend: str) -> None:
    model = make_mlp()
    with ca_runtime.enable(backend, capture_after=1):
        for _ in range(3):
            model(torch.randn(4, model[0].in_features)).sum().backward()
    entries = ca_runtime.cache_info()
    # .grad None on the first backward, defined on the next two.
    assert sorted(e.hits for e in entries) == [0, 1]
    assert len({e.key_path_length for e in entries}) == 1 and entries[0].key_path_length > len(model)
    assert not any(e.failed for e in entries)
    assert len([n for n in ca_core.cache_tree() if n.has_graph or n.failed]) == len(entries)


def test_cache_tree_shows_each_key_path_and_links_captured_graphs(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ca_runtime._runtime as runtime_module

    entry_ids: list[int] = []
    real_build = runtime_module.build_graph_module

    def recording_build(graph: ca_core.BackwardGraph) -> object:
        entry_ids.append(graph.entry_id)
        return real_build(graph)

    monkeypatch.setattr(runtime_module, "build_graph_module", recording_build)
    x = torch.randn(3, requires_grad=True)
    with ca_runtime.enable(backend, capture_after=1):
        for _ in range(3):
            (x * 2).sum().backward()
        (x.exp()).sum().backward()
    tree = {n.id: n for n in ca_core.cache_tree()}
    (root,) = [n for n in tree.values() if n.parent == -1 and n.compiler == f"backend:{backend}"]
    assert root.node_name == ""
    # Captures: (x*2) with .grad None, again with .grad defined, then exp: three entries.
    assert len(entry_ids) == 3 and all(tree[i].has_graph and not tree[i].failed for i in entry_ids)
    assert sorted(tree[i].hits for i in entry_ids) == [0, 0, 1]

    def path(node_id: int) -> list[str]:
        names = []
        while tree[node_id].parent != -1:
            names.append(tree[node_id].node_name)
            node_id = tree[node_id].parent
        return names[::-1]

    root_and_leaf = ("torch::autograd::GraphRoot", "torch::autograd::AccumulateGrad")
    assert path(entry_ids[0]) == [root_and_leaf[0], "SumBackward0", "MulBackward0", root_and_leaf[1]]
    assert path(entry_ids[2]) == [root_and_leaf[0], "SumBackward0", "ExpBackward0", root_and_leaf[1]]
    # Parents come before their children.
    order = [n.id for n in ca_core.cache_tree()]
    assert all(order.index(n.parent) < order.index(n.id) for n in tree.values() if n.parent != -1)


def test_step_timings_are_collected_only_when_asked(backend: str) -> None:
    x = torch.randn(3, requires_grad=True)
    try:
        with ca_runtime.enable(backend, capture_after=1):
            (x * 2).sum().backward()
            assert ca_core.timings()["timed_backwards"] == 0
            ca_core.set_timing(True)
            for _ in range(3):
                (x * 2).sum().backward()
            ca_core.set_timing(False)
            (x * 2).sum().backward()
    finally:
        ca_core.set_timing(False)
    timings = ca_core.timings()
    assert timings["timed_backwards"] == 3
    assert timings["walk_ns"] > 0 and timings["run_ns"] > 0 and timings["finish_ns"] > 0
    assert timings["lookup_ns"] > 0 and timings["hook_ns"] > 0
    ca_core.reset_counters()
    assert set(ca_core.timings().values()) == {0}


def test_the_hook_time_counts_a_nested_backward_once(backend: str) -> None:
    """hook_ns is the outermost hook's: a backward in a hook is inside it, not added again.

    The nested backward sleeps 0.2 s in its own hook; counted twice, hook_ns
    would exceed the outer backward's wall time.
    """
    x = torch.randn(3, requires_grad=True)

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
            return y * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            time.sleep(0.2)
            return g * 2

    def nested(grad: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():  # a backward without create_graph runs its hooks without grad mode
            y = x.detach().requires_grad_()
            torch.autograd.grad(Slow.apply(y).sum(), y)
        return grad

    ca_core.reset_counters()
    try:
        with ca_runtime.enable(backend, capture_after=1):
            ca_core.set_timing(True)
            out = x * 3
            out.register_hook(nested)
            start = time.perf_counter()
            out.sum().backward()
            wall_ns = (time.perf_counter() - start) * 1e9
    finally:
        ca_core.set_timing(False)
    timings = ca_core.timings()
    assert ca_runtime.stats()["captures"] == 1
    assert 0.2e9 <= timings["hook_ns"] <= wall_ns


def test_a_hit_follows_its_key_path_without_hashing(backend: str) -> None:
    """See [Note: The child taken last] in ca_core: a walk hashes a key only where it leaves the last path."""
    x = torch.randn(3, requires_grad=True)
    hashed: list[int] = []

    def step(i: int) -> torch.Tensor:
        # Two graphs that part at the node after the root's sum: exp, exp, cos, cos, exp, cos.
        x.grad = None
        y = x
        for _ in range(20):
            y = (y * 1.5).sin()
        loss = (y.exp() if i in (0, 1, 4) else y.cos()).sum()
        before = ca_core.timings()["keys_hashed"]
        loss.backward()
        hashed.append(ca_core.timings()["keys_hashed"] - before)
        return loss.detach()

    result = compare(step, backend, tensors={"x": x}, steps=6)
    result.assert_ok()
    assert result.stats["captures"] == 2 and result.stats["cache_hits"] == 4, result.stats
    first, hit, other, other_hit, back, back_again = hashed[-6:]
    assert first > 40 and other > 40  # every key of a capture is new
    # A hit on the path walked last hashes nothing; one that parts from it
    # hashes once, where it parts (the sum's child), and follows the rest.
    assert (hit, other_hit, back, back_again) == (0, 0, 1, 1)


# "alternate" starts with torch's, so it covers torch's first as well.
@pytest.mark.parametrize("order", ["ours_first", "alternate"])
def test_coexists_with_torch_builtin_compiled_autograd(order: str) -> None:
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent / "scripts" / "coexistence.py"
    proc = subprocess.run(
        [sys.executable, str(script), order, "aot_eager"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.endswith(("ok", "MISMATCH"))]
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert len(lines) == (12 if order == "alternate" else 4) and all(line.endswith(" ok") for line in lines)


def test_ca_logs_env_enables_miss_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    from ca_runtime import _log

    monkeypatch.setenv("CA_LOGS", " misses,")
    monkeypatch.setattr(_log.miss_log, "handlers", [])
    monkeypatch.setattr(_log.miss_log, "level", logging.NOTSET)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unknown: no warning
        _log._configure_from_env()
    assert _log.miss_log.handlers and _log.miss_log.isEnabledFor(logging.INFO)


def test_an_unknown_ca_logs_value_is_named_with_the_accepted_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from ca_runtime import _log

    monkeypatch.setenv("CA_LOGS", "all,misses")
    monkeypatch.setattr(_log.miss_log, "handlers", [])
    monkeypatch.setattr(_log.miss_log, "level", logging.NOTSET)
    with pytest.warns(UserWarning, match=r"CA_LOGS: 'all' ignored; it accepts misses"):
        _log._configure_from_env()
    assert _log.miss_log.handlers  # the known value still applies


def test_node_whose_trace_fails_runs_for_real_with_its_own_values(backend: str) -> None:
    # index_fill with a tensor value: tracing its backward fails in Dynamo's
    # fake propagation part-way through the node's swap, Dynamo graph-breaks
    # and runs it for real. The node's saved index must be its own again
    # (see [Note: Eager fast path] in ca_core), on every step and on a
    # retained graph's second backward.
    x = torch.randn((), requires_grad=True)
    value = torch.randn((), requires_grad=True)
    index = torch.tensor([0])

    def step() -> list[torch.Tensor]:
        out = x.index_fill(0, index, value) * 3.0
        loss = 0 + out.sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [x.grad.clone(), value.grad.clone()]

    result = compare(step, backend, tensors={"x": x, "value": value}, steps=3)
    result.assert_ok()


@pytest.mark.parametrize("scale", [2.0, 3])
def test_lifted_scalars_and_nothing_lifted_nodes_match_eager(backend: str, scale: float) -> None:
    # Nodes with no lifted tensors (sum, add), a lifted scalar (pow's
    # exponent, changed between steps) and shared saved tensors: the hit path
    # runs these as eager does only when handed exactly their own values.
    w = torch.randn(4, 3, requires_grad=True)

    def step(i: int) -> torch.Tensor:
        y = (w * w).pow(scale + i).sum(dim=1)
        return (y + 1).sum()

    def run(i: int) -> list[torch.Tensor]:
        step(i).backward()
        return [w.grad.clone()]

    result = compare(run, backend, tensors={"w": w}, steps=3, rtol=1e-4)
    result.assert_ok()


def test_reset_forgets_the_last_graph(backend: str) -> None:
    x = torch.ones(3, requires_grad=True)
    with ca_runtime.enable(backend, capture_after=1):
        (x * 2).sum().backward()
    assert ca_runtime.last_graph() is not None
    ca_runtime.reset()
    assert ca_runtime.last_graph() is None and ca_runtime.stats()["graph_breaks"] == 0
