"""Eager if faster: each cache entry times its hits both ways and serves them the faster way.

See [Note: Eager if faster] in ca_core (eager_if_faster.h). The timings are
made deterministic by a compiler_fn that sleeps in the compiled graph (eager
wins) and by a Function whose backward sleeps only when not traced (the
compiled graph wins). Every test compares with eager (grads, hook calls and
order) and checks how many backwards ran each way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ca_core
import ca_runtime
import ca_testkit
import pytest
import torch
from ca_runtime._report.html import render
from ca_runtime._report.model import build_report_data
from ca_testkit.scenarios import batch, make_mlp, mlp_step, slowed_compiler

#: An entry's schedule: untimed compiled hits, then timed runs per way.
WARMUP = 4
TIMED = 8
#: Steps that reach the choice and serve 3 backwards by it afterwards.
STEPS = 1 + WARMUP + 2 * TIMED + 3


def _slow_graph(backend: str) -> Callable[[torch.fx.GraphModule], Any]:
    """A compiler_fn whose graph is 20 ms slower than eager's backward of a small MLP (~0.2 ms).

    A wide margin: timed runs on a loaded machine (parallel test workers) are
    preempted for milliseconds.
    """
    return slowed_compiler(backend, 0.02)


def _entry() -> ca_runtime.CacheEntry:
    """The one entry with a graph (its compiler_fn must still be alive: its cache goes with it)."""
    (entry,) = [e for e in ca_runtime.cache_info() if e.eager_if_faster_choice]
    return entry


def _hooked_mlp_step() -> tuple[Callable[[int], tuple[torch.Tensor, list[str]]], torch.nn.Module]:
    calls: list[str] = []
    model = make_mlp()
    step = mlp_step(model)
    first = model[0].weight
    first.register_post_accumulate_grad_hook(lambda p: calls.append("acc w0"))

    def hooked(i: int) -> tuple[torch.Tensor, list[str]]:
        """The loss and the hook calls of this step, in order."""
        calls.clear()
        handle = model[2].register_full_backward_hook(lambda m, gi, go: calls.append(f"module {i}"))
        try:
            return step(i), list(calls)
        finally:
            handle.remove()

    return hooked, model


def test_a_graph_slower_than_eager_runs_on_the_eager_engine(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    step, model = _hooked_mlp_step()
    with caplog.at_level(logging.INFO, logger="ca_runtime"):
        compiler_fn = _slow_graph(backend)
        comparison = ca_testkit.compare(
            step, compiler_fn, tensors=list(model.parameters()), steps=STEPS, impl="ca-timed"
        )
    comparison.assert_ok()
    stats = comparison.stats
    assert stats["captures"] == 1 and stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    # WARMUP untimed and TIMED timed compiled hits; TIMED timed and 3 chosen eager runs.
    assert stats["cache_hits"] == WARMUP + TIMED and stats["eager_if_faster_runs"] == TIMED + 3, stats
    entry = _entry()
    assert (
        entry.eager_if_faster_choice is ca_runtime.EagerIfFasterChoice.EAGER
        and entry.eager_if_faster_choice == "eager"
    ), entry
    assert entry.eager_runs == TIMED + 3, entry
    assert entry.compiled_median_s > entry.eager_median_s + 0.015, entry
    assert entry.compiled_over_eager > 1.5, entry  # 20 ms more than a ~1 ms backward, per pair
    chose = [r.getMessage() for r in caplog.records if "its backwards now run" in r.getMessage()]
    assert len(chose) == 1 and chose[0].endswith("on the eager engine"), chose
    page = render(build_report_data(), "builtin")
    assert "runs eagerly, compiled not measurably faster" in page


#: A backward recognised without a walk is walked anyway one time in this
#: many; see [Note: Eager without the walk] in ca_core.
WALK_EVERY = 16


def test_a_backward_served_eagerly_by_choice_is_recognised_without_a_walk(backend: str) -> None:
    step, model = _hooked_mlp_step()
    extra = WALK_EVERY + 1
    compiler_fn = _slow_graph(backend)  # alive: its cache entries go with it
    comparison = ca_testkit.compare(
        step, compiler_fn, tensors=list(model.parameters()), steps=STEPS + extra, impl="ca-timed"
    )
    comparison.assert_ok()
    stats = comparison.stats
    assert stats["captures"] == 1 and stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    chosen = 3 + extra
    assert stats["cache_hits"] == WARMUP + TIMED and stats["eager_if_faster_runs"] == TIMED + chosen, stats
    # The first chosen run is walked and remembered; then WALK_EVERY - 1
    # without a walk, one walked, and the rest without.
    assert stats["eager_if_faster_without_walk"] == chosen - 2, stats
    assert _entry().eager_runs == TIMED + chosen


def _grad_mode_step(create_graph: bool, ambient: bool) -> tuple[Callable[[int], Any], list[str]]:
    """A step whose hooks record the grad mode they run in (the list of the last step's calls).

    Its backward is called with grad mode ``ambient``.
    """
    model = make_mlp()
    calls: list[str] = []
    model[0].weight.register_hook(lambda g: calls.append(f"tensor hook, grad {torch.is_grad_enabled()}"))
    model[2].register_full_backward_hook(
        lambda m, gi, go: calls.append(f"module hook, grad {torch.is_grad_enabled()}")
    )
    params = list(model.parameters())

    def step(i: int) -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
        calls.clear()
        x, y = batch(i)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        with torch.set_grad_enabled(ambient):
            grads = torch.autograd.grad(loss, params, create_graph=create_graph)
        return loss, [g.detach() for g in grads], list(calls)

    return step, calls


@pytest.mark.parametrize("ambient", [True, False], ids=["called-with-grad", "called-in-no-grad"])
@pytest.mark.parametrize(
    ("create_graph", "slow"),
    [(False, False), (True, False), (False, True)],
    ids=["compiled", "compiled-create-graph", "eager-by-choice"],
)
def test_hooks_run_in_the_backwards_grad_mode_whichever_way_it_is_served(
    create_graph: bool, slow: bool, ambient: bool
) -> None:
    """Grad mode in a backward is create_graph, whatever mode backward() was called in, as in eager.

    The hook sets the grad mode alone, not the task's whole thread-local
    state, and nothing on the eager engine; see [Note: The hook's grad mode].
    """
    step, calls = _grad_mode_step(create_graph, ambient)
    # Compiled: always the graph (ca-compiled); slow: its hits chose the eager engine (ca-timed).
    compiler_fn, impl = (_slow_graph("eager"), "ca-timed") if slow else ("eager", "ca-compiled")
    comparison = ca_testkit.compare(step, compiler_fn, steps=STEPS + 2, impl=impl)
    comparison.assert_ok()
    # The last step's calls, ours' (eager's matched them step by step).
    assert calls == [f"module hook, grad {create_graph}", f"tensor hook, grad {create_graph}"], calls
    stats = comparison.stats
    assert stats["captures"] == 1 and stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    if slow:
        # 5 backwards served by choice: the first walked and remembered, 4 without a walk.
        assert stats["cache_hits"] == WARMUP + TIMED and stats["eager_if_faster_runs"] == TIMED + 5, stats
        assert stats["eager_if_faster_without_walk"] == 4, stats
    else:
        assert stats["eager_if_faster_runs"] == 0 and stats["cache_hits"] == STEPS + 1, stats


def test_a_new_hook_is_captured_within_the_walk_interval_and_runs_meanwhile() -> None:
    model = make_mlp()
    plain = mlp_step(model)
    calls: list[str] = []
    handles: list[Any] = []
    hooked_at = STEPS + 2

    def doubling_hook(grad: torch.Tensor) -> torch.Tensor:
        calls.append("w0")
        return grad * 2

    def step(i: int) -> tuple[torch.Tensor, list[str]]:
        calls.clear()
        if i == 0:  # each run (eager's, ours) starts without the hook
            for handle in handles:
                handle.remove()
        if i == hooked_at:
            # Same fingerprint, a new key: a leaf's hook is part of its node's key.
            handles.append(model[0].weight.register_hook(doubling_hook))
        return plain(i), list(calls)

    steps = hooked_at + WALK_EVERY
    comparison = ca_testkit.compare(
        step, _slow_graph("eager"), tensors=list(model.parameters()), steps=steps, impl="ca-timed"
    )
    comparison.assert_ok()
    stats = comparison.stats
    assert stats["eager_if_faster_without_walk"] > 0, stats
    # The hooked graph was captured by the walk due at most WALK_EVERY backwards on.
    assert stats["captures"] == 2 and stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats


class _SlowWhenNotTraced(torch.autograd.Function):
    """Doubles; its backward sleeps 20 ms when it runs for real, not when Dynamo traces it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            time.sleep(0.02)
        return grad * 2


def test_a_graph_faster_than_eager_stays_compiled() -> None:
    model = make_mlp()

    def step(i: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(i))
        loss = _SlowWhenNotTraced.apply(model(x)).pow(2).sum()
        loss.backward()
        return loss

    comparison = ca_testkit.compare(
        step, "aot_eager", tensors=list(model.parameters()), steps=STEPS, impl="ca-timed"
    )
    comparison.assert_ok()
    stats = comparison.stats
    assert stats["captures"] == 1 and stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    # Only the timed eager runs; the 3 backwards after the choice are hits.
    assert stats["eager_if_faster_runs"] == TIMED and stats["cache_hits"] == WARMUP + TIMED + 3, stats
    entry = _entry()
    assert (
        entry.eager_if_faster_choice == "compiled" and entry.eager_median_s > entry.compiled_median_s + 0.015
    ), entry
    assert 0.0 < entry.compiled_over_eager < 0.5, entry


def test_eager_if_faster_false_always_runs_the_graph(backend: str) -> None:
    model = make_mlp()
    compiler_fn = _slow_graph(backend)
    comparison = ca_testkit.compare(
        mlp_step(model), compiler_fn, tensors=list(model.parameters()), steps=STEPS, impl="ca-compiled"
    )
    comparison.assert_ok()
    stats = comparison.stats
    assert (
        stats["captures"] == 1 and stats["cache_hits"] == STEPS - 1 and stats["eager_if_faster_runs"] == 0
    ), stats
    assert stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    entry = _entry()
    assert (
        entry.eager_if_faster_choice == "compiled"
        and entry.eager_runs == 0
        and entry.compiled_median_s == 0.0
    ), entry


def test_only_plain_backwards_are_timed(backend: str) -> None:
    """retain_graph=True backwards run compiled while the entry times: no timing is finished."""
    model = make_mlp()

    def step(i: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(i))
        loss = model(x).pow(2).sum()
        loss.backward(retain_graph=True)
        return loss

    compiler_fn = _slow_graph(backend)
    comparison = ca_testkit.compare(
        step, compiler_fn, tensors=list(model.parameters()), steps=STEPS, impl="ca-timed"
    )
    comparison.assert_ok()
    stats = comparison.stats
    assert stats["cache_hits"] == STEPS - 1 and stats["eager_if_faster_runs"] == 0, stats
    assert stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    assert _entry().eager_if_faster_choice == "compiled"


def test_the_choice_is_per_enable() -> None:
    """eager_if_faster is the installed enable()'s: False runs the graph and times nothing, same cache."""
    model = make_mlp()
    step = mlp_step(model)
    compiler_fn = _slow_graph("eager")
    with ca_runtime.enable(compiler_fn, eager_if_faster=False, capture_after=1):
        for i in range(3):
            step(i)
    assert _entry().eager_if_faster_choice == "compiled" and ca_runtime.stats()["eager_if_faster_runs"] == 0
    with ca_runtime.enable(compiler_fn, eager_if_faster=True, capture_after=1):
        for i in range(STEPS - 1):  # the graph was captured and ran already
            step(i)
    stats = ca_runtime.stats()
    assert _entry().eager_if_faster_choice == "eager" and stats["eager_if_faster_runs"] == TIMED + 3, stats
    with ca_runtime.enable(compiler_fn, eager_if_faster=False, capture_after=1):
        step(STEPS)
    after = ca_runtime.stats()
    assert (
        after["cache_hits"] == stats["cache_hits"] + 1
        and after["eager_if_faster_runs"] == stats["eager_if_faster_runs"]
    )
    assert after["captures"] == 1 and after["eager_fallbacks"] == 0 and after["graph_breaks"] == 0, after


def test_the_schedule_alternates_and_times_again_later() -> None:
    """Which way each backward ran: untimed hits, eager/compiled alternating in pairs, eager, then a new timing."""
    model = make_mlp()
    step = mlp_step(model)
    ran_compiled: list[int] = []
    inner = _slow_graph("eager")

    def compiler_fn(gm: torch.fx.GraphModule) -> Any:
        compiled = inner(gm)

        def run(*args: Any) -> Any:
            ran_compiled.append(current[0])
            return compiled(*args)

        return run

    current = [0]
    steps = 1 + WARMUP + 2 * TIMED + 500 + 2 * TIMED + 3
    with ca_runtime.enable(compiler_fn, eager_if_faster=True, capture_after=1):
        for i in range(steps):
            current[0] = i
            step(i)
    # Step i (i >= 1) is the entry's run i: a capture, WARMUP hits, then
    # eager, compiled, compiled, eager, ...; the next timing after 500 runs.
    abba = [k for k in range(2 * TIMED) if (k + 1) // 2 % 2 == 1]
    first = 1 + WARMUP
    second = first + 2 * TIMED + 500
    want = list(range(first)) + [first + k for k in abba] + [second + k for k in abba]
    assert ran_compiled == want
    stats = ca_runtime.stats()
    assert stats["captures"] == 1 and stats["cache_hits"] == WARMUP + 2 * TIMED, stats
    assert stats["eager_if_faster_runs"] == steps - 1 - WARMUP - 2 * TIMED, stats
    assert stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats


def test_new_sizes_are_a_miss_while_eager_is_chosen(backend: str) -> None:
    model = make_mlp()
    compiler_fn = _slow_graph(backend)

    def step(i: int) -> torch.Tensor:
        return mlp_step(model, n=6 if i < STEPS else 5)(i)

    comparison = ca_testkit.compare(
        step, compiler_fn, tensors=list(model.parameters()), steps=STEPS + 1, impl="ca-timed"
    )
    comparison.assert_ok()
    stats = comparison.stats
    # The new batch size is captured again (its sizes made dynamic), not run eagerly.
    assert stats["captures"] == 2 and stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats
    assert stats["eager_if_faster_runs"] == TIMED + 3, stats


def test_a_users_error_on_the_eager_engine_is_eagers_and_changes_nothing() -> None:
    model = make_mlp()
    step = mlp_step(model)
    fail = [False]

    def hook(grad: torch.Tensor) -> None:
        if fail[0]:
            raise ValueError("hook failed on purpose")

    model[0].bias.register_hook(hook)
    compiler_fn = _slow_graph("eager")
    with ca_runtime.enable(compiler_fn, eager_if_faster=True, capture_after=1):
        for i in range(STEPS):
            step(i)
        assert _entry().eager_if_faster_choice == "eager"
        before = ca_runtime.stats()
        fail[0] = True
        with pytest.raises(ValueError, match=r"^hook failed on purpose$"):
            step(STEPS)
        fail[0] = False
        loss = step(STEPS + 1)
        got = [p.grad.clone() for p in model.parameters()]
    after = ca_runtime.stats()
    assert after["captures"] == before["captures"] == 1 and after["eager_fallbacks"] == 0, (before, after)
    assert (
        after["eager_if_faster_runs"] == before["eager_if_faster_runs"] + 2
        and _entry().eager_if_faster_choice == "eager"
    )
    with ca_runtime.disable():
        torch.testing.assert_close(loss, step(STEPS + 1))
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_a_torch_compiled_regions_backward_is_not_timed_eagerly() -> None:
    """Run eagerly, AOTAutograd would compile that region's own backward graph: such graphs stay compiled."""
    model = make_mlp()
    compiled_model = torch.compile(model, backend="aot_eager")

    def step(i: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(i))
        loss = compiled_model(x).pow(2).sum()
        loss.backward()
        return loss

    compiler_fn = _slow_graph("eager")
    comparison = ca_testkit.compare(
        step, compiler_fn, tensors=list(model.parameters()), steps=STEPS, impl="ca-timed"
    )
    comparison.assert_ok()
    stats = comparison.stats
    assert stats["eager_if_faster_runs"] == 0 and stats["cache_hits"] == STEPS - 1, stats
    assert stats["eager_fallbacks"] == 0 and stats["graph_breaks"] == 0, stats


def test_eager_if_faster_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="eager_if_faster must be a bool, got int"):
        ca_runtime.enable("eager", eager_if_faster=1, capture_after=1)  # type: ignore[arg-type]


def test_the_default_runs_compiled_and_times_nothing() -> None:
    """Reproducible by default: a graph slower than eager still serves every hit; see [Note: A reproducible default]."""
    model = make_mlp()
    comparison = ca_testkit.compare(
        mlp_step(model), _slow_graph("eager"), tensors=list(model.parameters()), steps=STEPS
    )
    comparison.assert_ok()
    stats = comparison.stats
    assert (
        stats["captures"] == 1 and stats["cache_hits"] == STEPS - 1 and stats["eager_if_faster_runs"] == 0
    ), stats
    assert _entry().eager_if_faster_choice == "compiled" and _entry().compiled_median_s == 0.0


def test_deterministic_algorithms_turn_the_timing_off_with_one_warning() -> None:
    model = make_mlp()
    step = mlp_step(model)
    import ca_runtime._enable as enable_module

    enable_module._warned_once.discard("deterministic")
    torch.use_deterministic_algorithms(True)
    try:
        with (
            pytest.warns(RuntimeWarning, match="use_deterministic_algorithms") as caught,
            ca_runtime.enable(_slow_graph("eager"), eager_if_faster=True, capture_after=1),
        ):
            for i in range(STEPS):
                step(i)
    finally:
        torch.use_deterministic_algorithms(False)
    stats = ca_runtime.stats()
    assert (
        stats["captures"] == 1 and stats["cache_hits"] == STEPS - 1 and stats["eager_if_faster_runs"] == 0
    ), stats
    (warning,) = [w for w in caught if "use_deterministic_algorithms" in str(w.message)]
    assert warning.filename == __file__, warning.filename  # the user's `with enable(...)` line


def test_a_graph_on_an_asynchronous_device_is_not_timed() -> None:
    """A CPU clock times a CUDA graph's launches, not its work: a graph lifting non-CPU tensors runs compiled.

    The meta device stands in for CUDA (no kernels run at all, so a host
    clock would measure nothing of the work). The same graph on the CPU,
    20 ms slower compiled, is timed and served eagerly.
    """
    compiler_fn = _slow_graph("aot_eager")

    def run(device: str) -> tuple[dict[str, int], list[torch.Tensor]]:
        ca_runtime.reset()
        x = torch.randn(8, 8, device=device, requires_grad=True)
        w = torch.randn(8, 8, device=device, requires_grad=True)
        with ca_runtime.enable(compiler_fn, eager_if_faster=True, capture_after=1):
            for _ in range(STEPS):
                x.grad = w.grad = None
                ((x @ w).tanh() * 2).sum().backward()
            return ca_runtime.stats(), [x.grad, w.grad]

    stats, grads = run("meta")
    assert stats["captures"] == 1 and stats["eager_fallbacks"] == 0, stats
    assert stats["cache_hits"] == STEPS - 1 and stats["eager_if_faster_runs"] == 0, stats
    assert _entry().eager_if_faster_choice == "compiled" and _entry().eager_runs == 0
    assert all(g is not None and g.device.type == "meta" and g.shape == (8, 8) for g in grads)
    stats, _ = run("cpu")
    assert stats["eager_if_faster_runs"] == TIMED + 3, stats


def test_eager_if_faster_choice_is_ca_cores_member_for_member() -> None:
    """``CacheEntry.eager_if_faster_choice`` (a ``EagerIfFasterChoice``, equal to its string) is made of ``ca_core.EagerIfFasterChoice`` by name."""
    assert [ca_runtime.EagerIfFasterChoice.of(m) for m in ca_core.EagerIfFasterChoice] == list(
        ca_runtime.EagerIfFasterChoice
    )
    assert [str(m) for m in ca_runtime.EagerIfFasterChoice] == ["", "compiled", "eager"]
