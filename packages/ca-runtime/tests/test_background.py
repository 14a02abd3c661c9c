"""``enable("inductor", compile_in_background=True)`` against eager; see [Note: Compiling in the background]."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import warnings

import ca_runtime
import pytest
import torch
import torch.fx
from ca_runtime import _background
from ca_testkit import compare
from ca_testkit.scenarios import Cube, make_mlp


def _mlp() -> torch.nn.Sequential:
    return make_mlp(seed=0, sizes=(8, 16, 4))


def _step_with_hooks(model: torch.nn.Module, x: torch.Tensor, wait_at: int):
    """A step whose backward calls a tensor hook and a Python Function; waits for compiles at ``wait_at``."""

    def hook(g: torch.Tensor) -> torch.Tensor:
        # No Python side effect: Dynamo guards on a growing list's length and
        # would recompile every step. The doubled grads show that it ran.
        return g * 2

    def step(i: int):
        if i == wait_at:
            assert ca_runtime.wait_for_background_compiles(timeout=600)
        model.zero_grad(set_to_none=True)
        h = Cube.apply(model(x))
        h.register_hook(hook)
        loss = h.sin().sum()
        loss.backward()
        return loss.detach()

    return step


def _compare_mlp_with_hooks(wait_at: int, steps: int):
    model, x = _mlp(), torch.randn(5, 8)
    step = _step_with_hooks(model, x, wait_at=wait_at)
    return compare(step, "inductor", tensors=model, steps=steps, impl="ca-background", atol=1e-5)


@pytest.mark.inductor
def test_under_the_default_capture_after_the_second_backward_compiles_in_background() -> None:
    """enable()'s default (capture_after=2) with compile_in_background: eager, captured, eager while compiling, kernels.

    Every backward before the kernels are ready gives eager's grads bit for
    bit; the hook runs once per backward throughout.
    """

    def run(context: contextlib.AbstractContextManager[object]) -> list[tuple[list[torch.Tensor], int]]:
        model = _mlp()
        out = []
        with context:
            for i in range(6):
                if i == 4:
                    assert ca_runtime.wait_for_background_compiles(timeout=600)
                calls: list[int] = []
                h = model[0](torch.randn(5, 8, generator=torch.Generator().manual_seed(i)))
                h.register_hook(lambda g, calls=calls: calls.append(1))
                model[2](model[1](h)).sin().sum().backward()
                out.append(([p.grad.clone() for p in model.parameters()], len(calls)))
                model.zero_grad(set_to_none=True)
        return out

    eager = run(ca_runtime.disable())
    ca_runtime.reset()
    ours = run(ca_runtime.enable("inductor", compile_in_background=True))
    stats = ca_runtime.stats()
    assert (stats["deferred_captures"], stats["captures"], stats["background_compiles"]) == (1, 1, 1), stats
    assert stats["uncompiled_runs"] == 1 and stats["eager_fallbacks"] == 0, stats
    assert stats["cache_hits"] + stats["eager_while_compiling"] == 4, stats
    for i, ((grads_eager, calls_eager), (grads_ours, calls_ours)) in enumerate(zip(eager, ours, strict=True)):
        assert calls_ours == calls_eager == 1
        for e, o in zip(grads_eager, grads_ours, strict=True):
            if i < 4:
                assert torch.equal(e, o), i
            else:
                torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-6)


@pytest.mark.inductor
def test_background_compile_gives_eager_results_before_and_after_the_kernels_are_ready() -> None:
    result = _compare_mlp_with_hooks(wait_at=2, steps=4)
    result.assert_ok()
    stats = result.stats
    assert stats["captures"] == 1 and stats["background_compiles"] == 1, stats
    assert stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    # The capturing backward ran the graph uncompiled, the next one on the
    # eager engine if the compile was still going (see [Note: Eager while
    # compiling] in ca_core); the two after the wait ran Inductor's kernels.
    assert stats["uncompiled_runs"] == 1 and stats["eager_while_compiling"] <= 1, stats
    assert stats["cache_hits"] + stats["eager_while_compiling"] == 3, stats


@pytest.mark.inductor
def test_the_first_background_run_is_bitwise_eager() -> None:
    """It runs Dynamo's graph (the nodes' formulas), not the ATen graph with Inductor's decompositions in it."""
    model, x = make_mlp(seed=0, sizes=(64, 256, 256, 10)), torch.randn(32, 64)

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.nn.functional.gelu(model(x)).log_softmax(-1).sum().backward()
        return [p.grad for p in model.parameters()]

    expected = step()
    with ca_runtime.enable("inductor", compile_in_background=True, capture_after=1):
        got = step()
        assert ca_runtime.wait_for_background_compiles(timeout=600)
        compiled = step()
    stats = ca_runtime.stats()
    assert stats["captures"] == 1 and stats["uncompiled_runs"] == 1 and stats["cache_hits"] == 1, stats
    assert stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    # Inductor's kernels (the second step) round differently here, within tolerance.
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.inductor
def test_background_compile_swaps_in_the_kernels() -> None:
    model, x = _mlp(), torch.randn(5, 8)
    interval = sys.getswitchinterval()
    with ca_runtime.enable("inductor", compile_in_background=True, capture_after=1):
        model(x).sum().backward()
        assert ca_runtime.stats()["uncompiled_runs"] == 1
        assert ca_runtime.wait_for_background_compiles(timeout=600)
        assert sys.getswitchinterval() == interval  # see [Note: The GIL while compiling in the background]
        for _ in range(3):
            model.zero_grad(set_to_none=True)  # the same backward as the first: a cache hit
            model(x).sum().backward()
    stats = ca_runtime.stats()
    assert stats["uncompiled_runs"] == 1 and stats["cache_hits"] == 3 and stats["background_compiles"] == 1, (
        stats
    )


@pytest.mark.inductor
def test_backwards_while_the_kernels_compile_run_on_the_eager_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """See [Note: Eager while compiling] in ca_core: the compile is held until step 3 begins."""
    import threading

    import torch._inductor.compile_fx

    real_compile = torch._inductor.compile_fx.compile_fx_inner
    release = threading.Event()

    def held_compile(*args: object, **kwargs: object) -> object:
        assert release.wait(timeout=600)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", held_compile)
    model, x = _mlp(), torch.randn(5, 8)
    inner = _step_with_hooks(model, x, wait_at=3)
    seen: list[dict[str, int]] = []

    def step(i: int) -> torch.Tensor:
        if i == 3 and ca_runtime.stats()["captures"]:  # the compiled run (compare() runs eager first)
            seen.append(ca_runtime.stats())
            release.set()
        return inner(i)

    result = compare(step, "inductor", tensors=model, steps=5, impl="ca-background", atol=1e-5)
    result.assert_ok()
    # Steps 1 and 2 ran on the eager engine, step 0 the graph uncompiled, 3 and 4 the kernels.
    assert len(seen) == 1, seen
    before = seen[0]
    assert before["eager_while_compiling"] == 2 and before["cache_hits"] == 0, before
    stats = result.stats
    assert stats["eager_while_compiling"] == 2 and stats["uncompiled_runs"] == 1, stats
    assert stats["cache_hits"] == 2 and stats["eager_fallbacks"] == 0 and stats["captures"] == 1, stats


@pytest.mark.inductor
def test_compiles_started_back_to_back_run_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps 0-3 each end in a different op, so each captures a graph and starts a compile.

    Two Inductor compiles at once fail inside Inductor (the failed graph would
    then run uncompiled for good); see [Note: One Inductor compile at a time].
    Each compile here also sleeps 2 s, so that the next step's starts while it runs.
    """
    import threading
    import time

    import torch._inductor.compile_fx

    real_compile = torch._inductor.compile_fx.compile_fx_inner
    running, most = [0], [0]
    counting = threading.Lock()

    def slow_compile(*args: object, **kwargs: object) -> object:
        with counting:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(2)
            return real_compile(*args, **kwargs)
        finally:
            with counting:
                running[0] -= 1

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", slow_compile)
    model, x = _mlp(), torch.randn(5, 8)
    uncompiled_after_wait: list[int] = []
    ends = [torch.sin, torch.cos, torch.exp, torch.tanh]

    def step(i: int) -> torch.Tensor:
        if i == 4:
            assert ca_runtime.wait_for_background_compiles(timeout=600)
            uncompiled_after_wait.append(ca_runtime.stats()["uncompiled_runs"])
        model.zero_grad(set_to_none=True)
        loss = ends[i % 4](model(x)).sum()
        loss.backward()
        return loss.detach()

    result = compare(step, "inductor", tensors=model, steps=6, impl="ca-background", atol=1e-5)
    result.assert_ok()
    assert most[0] == 1, most
    stats = result.stats
    assert stats["captures"] == 4 and stats["eager_fallbacks"] == 0, stats
    assert stats["background_compiles"] == 4, stats
    # Every graph compiled: after the wait, no step ran uncompiled or eagerly.
    assert uncompiled_after_wait[-1] == 4 and stats["uncompiled_runs"] == 4, (uncompiled_after_wait, stats)
    assert stats["cache_hits"] == 2 and stats["eager_while_compiling"] == 0, stats


class _Block(torch.nn.Module):
    """Attention, layer norm and an MLP: the ops a transformer's backward graph is made of."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x))


def _checkpointed(block: _Block, x: torch.Tensor) -> torch.Tensor:
    import torch.utils.checkpoint

    return block.head(torch.utils.checkpoint.checkpoint(block.layer, x, use_reentrant=False))


@pytest.mark.inductor
@pytest.mark.parametrize("setup", ["transformer", "compiled-forward", "checkpoint"])
def test_background_compile_of_training_setups_gives_eager_results(setup: str) -> None:
    """The uncompiled runs execute AOTAutograd's ATen graph (SDPA, layer norm, an
    AOT backward copied in, the checkpoint recompute op) before and after the swap."""
    block, x = _Block(), torch.randn(2, 5, 16)
    forward = {
        "transformer": block,
        "compiled-forward": torch.compile(block, backend="aot_eager"),
        "checkpoint": lambda t: _checkpointed(block, t),
    }[setup]

    def step(i: int) -> torch.Tensor:
        if i == 2:
            assert ca_runtime.wait_for_background_compiles(timeout=600)
        block.zero_grad(set_to_none=True)
        loss = forward(x).square().mean()
        loss.backward()
        return loss.detach()

    result = compare(step, "inductor", tensors=block, steps=4, impl="ca-background", atol=1e-5, rtol=1e-4)
    result.assert_ok()
    stats = result.stats
    assert stats["captures"] == 1 and stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    assert stats["background_compiles"] == 1, stats
    if setup == "compiled-forward":
        # A torch.compile'd region's backward: the graph, uncompiled, serves
        # the backwards while the kernels compile (see Runtime.take_compiling).
        assert 1 <= stats["uncompiled_runs"] <= 2 and stats["eager_while_compiling"] == 0, stats
    else:
        assert stats["uncompiled_runs"] == 1 and stats["eager_while_compiling"] <= 1, stats
    assert stats["cache_hits"] + stats["eager_while_compiling"] == 3, stats


@pytest.mark.inductor
def test_the_thread_compiles_with_the_captures_inductor_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Config values are per thread (context variables); see [Note: State at capture time]."""
    import threading

    import torch._inductor.compile_fx
    import torch._inductor.config

    real_compile = torch._inductor.compile_fx.compile_fx_inner
    seen: list[tuple[str, bool]] = []

    def recording_compile(*args: object, **kwargs: object) -> object:
        seen.append((threading.current_thread().name, torch._inductor.config.fx_graph_cache))
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", recording_compile)
    with torch._inductor.config.patch(fx_graph_cache=not torch._inductor.config.fx_graph_cache):
        wanted = torch._inductor.config.fx_graph_cache
        _compare_mlp_with_hooks(wait_at=1, steps=2).assert_ok()
    assert seen == [("ca-inductor-compile", wanted)], seen


@pytest.mark.inductor
def test_global_state_changed_before_the_thread_compiles_defers_the_compile_to_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """See [Note: State at capture time]: the thread sees other flags than the capture, so it compiles nothing."""
    import threading

    import torch._inductor.compile_fx

    real_compile = torch._inductor.compile_fx.compile_fx_inner
    compiled_on: list[str] = []

    def changed_since(global_state: object) -> str:
        return "" if threading.current_thread() is threading.main_thread() else "deterministic algorithms"

    def recording_compile(*args: object, **kwargs: object) -> object:
        compiled_on.append(threading.current_thread().name)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(_background, "_changed_since", changed_since)
    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", recording_compile)
    result = _compare_mlp_with_hooks(wait_at=1, steps=3)
    result.assert_ok()
    # Nothing compiled on the thread; step 1's call compiled on the main thread and ran the kernels.
    assert compiled_on == ["MainThread"], compiled_on
    assert result.stats["uncompiled_runs"] == 1 and result.stats["eager_fallbacks"] == 0, result.stats


def test_the_uncompiled_copy_shares_tensors_but_no_graph_with_the_one_inductor_rewrites() -> None:
    """Inductor's passes rewrite graphs in place, higher-order ops' subgraphs too; tensors must stay shared."""
    inner = torch.fx.GraphModule(torch.nn.Module(), _graph_calling(torch.ops.aten.cos.default).graph)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    weight = graph.get_attr("weight")
    graph.output([graph.call_module("body", (graph.call_function(torch.mul, (x, weight)),))])
    root = torch.nn.Module()
    root.body = inner
    root.weight = torch.full((3,), 2.0)
    gm = torch.fx.GraphModule(root, graph)
    copied = _background._graph_copy(gm)
    assert (
        copied.graph is not gm.graph and copied.body is not gm.body and copied.body.graph is not gm.body.graph
    )
    assert copied.weight is gm.weight
    gm.weight.fill_(3.0)  # the copy reads the value the original would
    (out,) = copied(torch.ones(3))
    assert torch.equal(out[0], torch.full((3,), 3.0).cos())


def test_a_failed_background_compile_warns_and_keeps_eager_results(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.compile_fx

    def failing_compile(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler today")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", failing_compile)
    model, x = _mlp(), torch.randn(5, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compare(
            _step_with_hooks(model, x, wait_at=1), "inductor", tensors=model, steps=3, impl="ca-background"
        )
    result.assert_ok()
    messages = [str(w.message) for w in caught if issubclass(w.category, ca_runtime.EagerFallbackWarning)]
    assert len(messages) == 1 and "no C++ compiler today" in messages[0], messages
    assert "keeps running op by op" in messages[0]
    stats = result.stats
    assert stats["captures"] == 1 and stats["uncompiled_runs"] == 3 and stats["eager_fallbacks"] == 0, stats


def test_compile_in_background_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="compile_in_background must be a bool"):
        ca_runtime.enable("inductor", compile_in_background="yes", capture_after=1)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"compile_in_background=True needs compiler_fn='inductor'.*aot_eager"
    ):
        ca_runtime.enable("aot_eager", compile_in_background=True, capture_after=1)
    with pytest.raises(ValueError, match="timeout"):
        ca_runtime.wait_for_background_compiles(timeout=-1)
    assert ca_runtime.wait_for_background_compiles(timeout=0)  # nothing running


def _graph_calling(target: object) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output([graph.call_function(target, (x,))])
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize(
    ("target", "kwargs", "reason"),
    [
        (torch.ops.aten.sin.default, {"is_inference": True}, None),
        (torch.ops.aten.sin.default, {"is_inference": False}, "needs autograd"),
        (torch.ops.aten.sin.default, {"is_inference": True, "cpp_wrapper": True}, "cpp_wrapper"),
        (torch.ops._c10d_functional.wait_tensor.default, {"is_inference": True}, "collective"),
    ],
)
def test_which_graphs_compile_on_the_calling_thread(target: object, kwargs: dict, reason: str | None) -> None:
    found = _background._reason_to_compile_here(_graph_calling(target), [torch.randn(3)], kwargs)
    assert found is None if reason is None else reason in found


def test_a_graph_with_symbolic_sizes_compiles_on_the_calling_thread() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake = mode.from_tensor(torch.randn(4, 3), symbolic_context=None)
    symbolic = torch.fx.experimental.symbolic_shapes.ShapeEnv().create_unbacked_symint()
    graph = _graph_calling(torch.ops.aten.sin.default)
    assert _background._reason_to_compile_here(graph, [fake], {"is_inference": True}) is None
    assert "symbolic" in _background._reason_to_compile_here(graph, [fake, symbolic], {"is_inference": True})


@pytest.mark.inductor
def test_the_process_exits_cleanly_while_a_compile_runs(tmp_path) -> None:
    script = tmp_path / "exit_while_compiling.py"
    script.write_text(
        textwrap.dedent(
            """
            import ca_runtime, torch
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
            with ca_runtime.enable("inductor", compile_in_background=True, capture_after=1):
                model(torch.randn(4, 8)).sum().backward()
            assert ca_runtime.stats()["background_compiles"] == 1
            print("exiting", flush=True)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exiting" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "failed to compile" not in done.stderr, done.stderr[
        -3000:
    ]  # see [Note: Compiling in the background]
