"""enable() end to end: MLP grads, cache hits, grad/inputs=, accumulation, bad input,
whole-backward fallback, restoring the prior hook on exit (threads too). Each compares against eager via ca_testkit."""

from __future__ import annotations

import warnings

import ca_core
import ca_runtime
import ca_testkit
import pytest
import torch
from ca_testkit.scenarios import Cube, batch, make_mlp, mlp_step


def test_mlp_three_steps_one_capture(backend: str) -> None:
    model = make_mlp()
    result = ca_testkit.compare(mlp_step(model), backend, tensors=model, steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1
    assert result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0


def test_mlp_with_compiler_fn_callable(backend: str) -> None:
    model = make_mlp()
    seen = []

    def compiler_fn(gm: torch.fx.GraphModule):
        seen.append(gm)
        return torch.compile(gm, backend=backend)

    result = ca_testkit.compare(mlp_step(model), compiler_fn, tensors=model, steps=2)
    result.assert_ok()
    assert len(seen) == 1
    targets = {getattr(n.target, "__name__", "") for n in seen[0].graph.nodes}
    assert "apply_nodes" in targets  # see [Note: Runs of nodes in one call] in ca_core


@pytest.mark.inductor
def test_mlp_inductor() -> None:
    model = make_mlp()
    result = ca_testkit.compare(mlp_step(model), "inductor", tensors=model, steps=3, atol=1e-5)
    result.assert_ok()
    assert result.stats["captures"] == 1
    assert result.stats["cache_hits"] == 2


def test_grads_accumulate_without_zero_grad(backend: str) -> None:
    model = make_mlp()

    def step(i: int) -> torch.Tensor:
        x, y = batch(i)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # no zero_grad: the second step adds to .grad
        return loss

    ca_testkit.compare(step, backend, tensors=model, steps=2).assert_ok()


def test_autograd_grad_wrt_input(backend: str) -> None:
    model = make_mlp()
    x, y = batch(0)
    x.requires_grad_(True)

    def step() -> tuple[torch.Tensor, ...]:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        return torch.autograd.grad(loss, [x])

    result = ca_testkit.compare(step, backend, tensors={"x": x, **dict(model.named_parameters())})
    result.assert_ok()
    assert result.stats["captures"] == 1
    assert x.grad is None and all(p.grad is None for p in model.parameters())


def test_backward_inputs_only_touches_listed(backend: str) -> None:
    model = make_mlp()
    first = model[0].weight

    def step() -> torch.Tensor:
        x, y = batch(0)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward(inputs=[first])
        return loss

    result = ca_testkit.compare(step, backend, tensors=model)
    result.assert_ok()
    assert first.grad is not None
    assert all(p.grad is None for p in model.parameters() if p is not first)


def test_enable_rejects_non_callable() -> None:
    with pytest.raises(TypeError, match="compiler_fn"), ca_runtime.enable(42):  # type: ignore[arg-type]
        pass
    assert ca_core.installed_runtime() is None


def test_enable_rejects_unknown_backend_listing_valid_ones() -> None:
    with (
        pytest.raises(ValueError, match=r"compiler_fn.*'no_such_backend'.*aot_eager.*inductor"),
        ca_runtime.enable("no_such_backend"),
    ):
        pass
    assert ca_core.installed_runtime() is None


def test_unknown_backend_suggests_the_nearest_and_hides_testing_only() -> None:
    with pytest.raises(ValueError, match="did you mean 'inductor'") as info:
        ca_runtime.enable("inductr")
    assert "TESTING_ONLY" not in str(info.value)


def test_a_backend_name_is_checked_against_torchs_list_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """enable("aot_eager") around every backward reads torch's backend list on its first call only."""
    from ca_runtime import _enable

    reads: list[object] = []
    real = torch.compiler.list_backends

    def counted(*args: object, **kwargs: object) -> list[str]:
        reads.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.compiler, "list_backends", counted)
    monkeypatch.setattr(_enable, "_BACKENDS_FOUND_VALID", set())
    for _ in range(3):
        with ca_runtime.enable("aot_eager"):
            pass
    assert len(reads) == 1
    with pytest.raises(ValueError, match="did you mean 'aot_eager'"):
        ca_runtime.enable("aot_eagr")  # an unknown name reads the list again
    assert len(reads) == 2


def test_enable_never_entered_warns(recwarn: pytest.WarningsRecorder) -> None:
    ca_runtime.enable("eager")  # a plain call: nothing would be compiled
    assert [str(w.message) for w in recwarn if w.category is RuntimeWarning] == [
        (
            "ca_runtime.enable(...) was called but never entered, so nothing is compiled: "
            "use it as `with ca_runtime.enable(...):` around the backward"
        )
    ]
    assert ca_core.installed_runtime() is None
    with ca_runtime.enable("eager"):
        pass
    assert not [w for w in recwarn if w.category is RuntimeWarning][1:]


def test_contexts_left_out_of_order_keep_the_innermost_open_one() -> None:
    """See [Note: Contexts entered on several threads]: A enters, B enters, A leaves, B leaves."""
    a, b = ca_runtime.enable("eager"), ca_runtime.enable("aot_eager")
    runtime_a = a.__enter__()
    runtime_b = b.__enter__()
    a.__exit__(None, None, None)
    assert ca_core.installed_runtime() is runtime_b  # B still open: still in force
    b.__exit__(None, None, None)
    assert ca_core.installed_runtime() is None  # what was there before A
    # A disable() opened inside and left after its enable() behaves the same.
    c, d = ca_runtime.enable("eager"), ca_runtime.disable()
    runtime_c = c.__enter__()
    d.__enter__()
    assert ca_core.installed_runtime() is None
    c.__exit__(None, None, None)
    assert ca_core.installed_runtime() is None
    d.__exit__(None, None, None)
    assert ca_core.installed_runtime() is None and runtime_c is not runtime_a


def test_two_threads_enter_and_leave_in_any_order(backend: str) -> None:
    import threading

    entered = [threading.Event(), threading.Event()]
    leave = [threading.Event(), threading.Event()]
    seen: dict[int, object] = {}
    grads: dict[int, torch.Tensor] = {}

    def worker(k: int) -> None:
        with ca_runtime.enable(backend, capture_after=1) as runtime:
            seen[k] = runtime
            entered[k].set()
            leave[k].wait(10)
            x = torch.ones(3, requires_grad=True)
            (x * (k + 2)).sum().backward()
            grads[k] = x.grad

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    threads[0].start()
    assert entered[0].wait(10)
    threads[1].start()
    assert entered[1].wait(10)
    leave[0].set()  # the first one to enter leaves first
    threads[0].join(10)
    assert ca_core.installed_runtime() is seen[1]
    leave[1].set()
    threads[1].join(10)
    assert ca_core.installed_runtime() is None
    assert torch.equal(grads[0], torch.full((3,), 2.0)) and torch.equal(grads[1], torch.full((3,), 3.0))
    assert ca_runtime.stats()["captures"] >= 1


def test_exception_inside_context_restores_prior_hook() -> None:
    with ca_runtime.enable("eager") as outer:
        with pytest.raises(RuntimeError, match="boom"), ca_runtime.enable("aot_eager") as inner:
            assert ca_core.installed_runtime() is inner
            raise RuntimeError("boom")
        assert ca_core.installed_runtime() is outer
    assert ca_core.installed_runtime() is None


def test_leaving_enable_restores_eager_and_reset_empties_cache(backend: str) -> None:
    model = make_mlp()
    step = mlp_step(model)
    with ca_runtime.enable(backend, capture_after=1):
        step(0)
    assert ca_runtime.cache_info()
    before = ca_runtime.stats()
    step(1)  # eager now: no counter moves
    assert ca_runtime.stats() == before
    ca_runtime.reset()
    assert ca_runtime.cache_info() == []
    assert ca_runtime.stats()["captures"] == 0


def test_torch_dynamo_reset_inside_enable_keeps_our_hook(backend: str) -> None:
    """torch._dynamo.reset() empties the engine's compiled-autograd slot; see [Note: torch clears the engine slot]."""
    model = make_mlp()
    step = mlp_step(model)
    with ca_runtime.enable(backend, capture_after=1):
        step(0)
        torch._dynamo.reset()
        step(1)
        step(2)
    stats = ca_runtime.stats()
    assert stats["captures"] + stats["cache_hits"] == 3 and stats["eager_fallbacks"] == 0, stats


def test_unsupported_node_falls_back_with_one_warning(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # No built-in rule declares a node unsupported any more; a row added to
    # the table exercises the whole-backward fallback it would cause.
    from ca_runtime import _node_rules

    row = _node_rules.NodeRule(
        "torch::autograd::PyNode", _node_rules.Handling.UNSUPPORTED, "declared unsupported", name="Cube*"
    )
    monkeypatch.setattr(_node_rules, "NODE_RULES", (row, *_node_rules.NODE_RULES))
    model = make_mlp()

    def step(i: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x, y = batch(i)
        loss = torch.nn.functional.cross_entropy(Cube.apply(model(x)), y)
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ca_testkit.compare(step, backend, tensors=model, steps=3, expect_capture=False)
    result.assert_ok()
    fallback_warnings = [w for w in caught if issubclass(w.category, ca_runtime.EagerFallbackWarning)]
    assert len(fallback_warnings) == 1
    assert "CubeBackward" in str(fallback_warnings[0].message)
    assert result.stats["eager_fallbacks"] == 3
    assert result.stats["captures"] == 0


def test_failing_compiler_falls_back(backend: str) -> None:
    model = make_mlp()

    def broken(gm: torch.fx.GraphModule):
        raise RuntimeError("compiler exploded")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ca_testkit.compare(mlp_step(model), broken, tensors=model, steps=3, expect_capture=False)
    result.assert_ok()
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, ca_runtime.EagerFallbackWarning)]
    assert len(fallbacks) == 1 and "compiler exploded" in fallbacks[0]  # the key path is remembered
    assert result.stats["eager_fallbacks"] == 3


def test_backend_failing_on_first_run_falls_back() -> None:
    # torch.compile is lazy: the backend runs (and fails) on the graph's first call.
    def exploding_backend(gm, example_inputs):
        raise RuntimeError("backend exploded")

    model = make_mlp()
    compiler = lambda gm: torch.compile(gm, backend=exploding_backend)
    with pytest.warns(ca_runtime.EagerFallbackWarning, match="backend exploded"):
        result = ca_testkit.compare(mlp_step(model), compiler, tensors=model, steps=2)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 2


def test_torch_builtin_hook_is_restored_after_ours() -> None:
    model = make_mlp()
    step = mlp_step(model)
    torch_ca = torch._dynamo.compiled_autograd
    counters = torch._dynamo.utils.counters["compiled_autograd"]
    with torch_ca._enable(lambda gm: torch.compile(gm, backend="eager")):
        with ca_runtime.enable("eager", capture_after=1):
            step(0)
        assert ca_runtime.stats()["captures"] == 1
        before = counters["captures"]
        step(1)  # functionals bound to ours first are shared with torch's ops
        assert counters["captures"] > before
    assert ca_runtime.stats()["captures"] == 1


def test_dynamo_traces_through_our_calls_to_aten() -> None:
    from torch._dynamo.backends.common import aot_autograd

    aten_graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs):
        aten_graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=record)
    model = make_mlp()
    result = ca_testkit.compare(
        mlp_step(model), lambda gm: torch.compile(gm, backend=backend, fullgraph=True), tensors=model, steps=2
    )
    result.assert_ok()
    assert len(aten_graphs) == 1
    targets = [n.target for n in aten_graphs[0].graph.nodes if n.op == "call_function"]
    assert targets and all(isinstance(t, torch._ops.OpOverload) for t in targets), targets


def test_shared_tensors_are_lifted_once_and_aliasing_is_keyed(backend: str) -> None:
    w = torch.randn(4, 4, requires_grad=True)

    def step(i: int) -> torch.Tensor:
        w.grad = None
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        # steps 0 and 1: both matmuls save the same x (one graph input);
        # step 2: equal values in two tensors, a different aliasing pattern
        x2 = x if i < 2 else x.clone()
        loss = ((x @ w) * (x2 @ w)).sum()
        loss.backward()
        return loss

    result = ca_testkit.compare(step, backend, tensors={"w": w}, steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 2
    assert result.stats["cache_hits"] == 1


def test_a_saved_outputs_aliases_are_one_graph_input(backend: str) -> None:
    """log_softmax's result, saved by LogSoftmaxBackward (as its output) and by NllLossBackward: one input.

    See [Note: Aliases of a saved output] in ca_core: before, each unpack's
    TensorImpl was an input of its own, two on one storage.
    """
    w = torch.randn(4, 6, requires_grad=True)
    target = torch.tensor([0, 5, 2])
    inputs_seen: list[list[torch.Tensor]] = []

    def compiler(gm: torch.fx.GraphModule) -> object:
        compiled = torch.compile(gm, backend=backend, fullgraph=True)

        def run(inputs: list[torch.Tensor], *rest: object) -> object:
            inputs_seen.append(list(inputs))
            return compiled(inputs, *rest)

        return run

    def step(i: int) -> torch.Tensor:
        w.grad = None
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        loss = torch.nn.functional.nll_loss(torch.log_softmax(x @ w, dim=1), target)
        loss.backward()
        return loss

    result = ca_testkit.compare(step, compiler, tensors={"w": w}, steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0
    assert len(inputs_seen) == 3
    for inputs in inputs_seen:
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        assert len(storages) == len(inputs), [tuple(t.shape) for t in inputs]
        assert any(t.shape == (3, 6) for t in inputs)  # the log-softmax output, lifted once


HOOKED_STEPS = {
    "tensor_hook": lambda h, w: h.register_hook(lambda g: g * 3),
    "leaf_tensor_hook": lambda h, w: w.register_hook(lambda g: g + 1),
    "retain_grad": lambda h, w: h.retain_grad(),
    "grad_fn_prehook": lambda h, w: h.grad_fn.register_prehook(lambda gs: tuple(g * 2 for g in gs)),
    "grad_fn_hook": lambda h, w: h.grad_fn.register_hook(
        lambda gi, go: tuple(None if g is None else g * 2 for g in gi)
    ),
}


@pytest.mark.parametrize("kind", sorted(HOOKED_STEPS))
@pytest.mark.filterwarnings("ignore::ca_runtime.GraphBreakWarning")
def test_hooks_are_captured_without_fallback(backend: str, kind: str) -> None:
    # Each hook kind runs in (or beside, for retain_grad) the compiled graph:
    # eager's grads, no whole-backward fallback, never a skipped hook.
    w = torch.randn(4, 4, requires_grad=True)
    retained = []

    def step() -> torch.Tensor:
        w.grad = None
        h = torch.randn(2, 4, generator=torch.Generator().manual_seed(0)) @ w
        handle = HOOKED_STEPS[kind](h, w)
        loss = (h.sin() * 2).sum()
        loss.backward()
        if handle is not None:
            handle.remove()
        if kind == "retain_grad":
            retained.append(h.grad.clone())
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error", ca_runtime.EagerFallbackWarning)
        result = ca_testkit.compare(step, backend, tensors={"w": w})
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0
    assert result.stats["captures"] == 1
    if kind == "retain_grad":
        assert torch.equal(retained[0], retained[1])


def test_post_accumulate_grad_hook_runs_in_real_node(backend: str) -> None:
    model = make_mlp()
    calls: list[str] = []

    def halve(name: str):
        def hook(t: torch.Tensor) -> None:
            calls.append(name)
            t.grad.mul_(0.5)  # the optimizer-in-backward pattern

        return hook

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(halve(name))
    result = ca_testkit.compare(mlp_step(model), backend, tensors=model, steps=2)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["eager_fallbacks"] == 0
    half = len(calls) // 2
    assert sorted(calls[:half]) == sorted(calls[half:]) and half == 4 * 2


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_node_that_cannot_be_walked_falls_back_naming_it(backend: str) -> None:
    # Nested tensors fail in the walk itself (compiled_args / input metadata).
    parts = [torch.randn(2, 3), torch.randn(3, 3)]
    leaves = []

    def step() -> tuple[torch.Tensor, ...]:
        x = torch.nested.nested_tensor(parts, requires_grad=True)
        loss = torch.nested.to_padded_tensor(x * 2, 0.0).sum()
        loss.backward()
        leaves.append(x)
        return x.grad.unbind()

    # The failure is remembered on the path up to the node: later backwards
    # go eager at once, without another warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ca_testkit.compare(step, backend, steps=3, expect_capture=False)
    result.assert_ok()
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, ca_runtime.EagerFallbackWarning)]
    assert (
        len(fallbacks) == 1 and "ToPaddedTensorBackward0" in fallbacks[0] and "NestedTensor" in fallbacks[0]
    )
    assert result.stats["eager_fallbacks"] == 3


def test_hook_and_cache_are_released_at_exit() -> None:
    """See [Note: Releasing at exit]: nothing of ours is left for interpreter finalisation."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import atexit, ca_core
        # Registered before ca_runtime's handler, so it runs after it.
        atexit.register(lambda: print("at exit:", ca_core.installed_runtime() is None, sum(n.has_graph for n in ca_core.cache_tree())))
        import ca_runtime, torch
        x = torch.randn(3, requires_grad=True)
        context = ca_runtime.enable("eager", capture_after=1)
        context.__enter__()  # left installed on purpose
        (x * x).sum().backward()
        print("before exit:", ca_core.installed_runtime() is None, sum(n.has_graph for n in ca_core.cache_tree()))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "before exit: False 1" in proc.stdout, proc.stdout
    assert "at exit: True 0" in proc.stdout, proc.stdout


def test_one_context_entered_twice_is_refused_and_leaks_nothing() -> None:
    ctx = ca_runtime.enable("eager", capture_after=1)
    with ctx, pytest.raises(RuntimeError, match="already open"), ctx:
        pass
    assert ca_core.installed_runtime() is None
