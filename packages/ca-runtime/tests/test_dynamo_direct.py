"""Cache hits call Dynamo's cached code directly; see [Note: Calling Dynamo's cached code directly].

Each test compares against eager and counts which way the graph calls went:
``direct_calls()`` counts the direct ones, Dynamo's ``unique_graphs`` its
compiles (a recompile proves the call went the normal way).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import ca_runtime
import pytest
import torch
from ca_runtime import _torch_interop
from ca_runtime._dynamo_direct import DirectDynamoCall, _runs_one_graph, direct_calls, wrap_if_dynamo_module
from ca_testkit import compare
from ca_testkit.scenarios import batch, make_mlp, mlp_step
from torch._dynamo.utils import counters


def _mlp_step(model: torch.nn.Module, before: Callable[[int], None] = lambda i: None) -> Callable[[int], Any]:
    """``mlp_step`` after ``before(i)``."""
    train = mlp_step(model)

    def step(i: int) -> torch.Tensor:
        before(i)
        return train(i).detach()

    return step


def _compare(
    step: Callable[[int], Any], backend: str, model: torch.nn.Module, steps: int
) -> tuple[dict, int]:
    counters.clear()
    start = direct_calls()
    result = compare(step, backend, tensors=model, steps=steps)
    result.assert_ok()
    assert result.stats["eager_fallbacks"] == 0 and result.stats["graph_breaks"] == 0, result.stats
    return result.stats, direct_calls() - start


def test_every_hit_is_direct(backend: str) -> None:
    model = make_mlp()
    stats, direct = _compare(_mlp_step(model), backend, model, steps=4)
    assert stats["captures"] == 1 and stats["cache_hits"] == 3
    assert direct == 3
    assert counters["stats"]["unique_graphs"] == 1


def test_a_graph_with_hundreds_of_outputs_is_direct_too(backend: str) -> None:
    """Dynamo's transformed code for a graph of more than 256 values has EXTENDED_ARG prefixes (an LSTM over 48 steps)."""
    leaves = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(3)) for _ in range(300))

    def step(i: int) -> torch.Tensor:
        leaves.zero_grad()
        loss = sum((p * 1.5).sin().sum() for p in leaves)
        loss.backward()
        return loss.detach()

    stats, direct = _compare(step, backend, leaves, steps=3)
    assert stats["captures"] == 1 and stats["cache_hits"] == 2
    assert direct == 2


def test_a_hit_flattens_its_inputs_without_pytree(monkeypatch: pytest.MonkeyPatch) -> None:
    """See [Note: A stolen list flattened without pytree]: AOTAutograd's wrapper of a graph taking a list."""
    import torch.utils._pytree as pytree

    calls = []
    flatten = pytree.arg_tree_leaves

    def counted(*args: Any, **kwargs: Any) -> list[Any]:
        calls.append(len(args))
        return flatten(*args, **kwargs)

    monkeypatch.setattr(pytree, "arg_tree_leaves", counted)
    leaves = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(3)) for _ in range(30))

    per_backward = []

    def step(i: int) -> torch.Tensor:
        leaves.zero_grad()
        loss = sum((p * 1.5).sin().sum() for p in leaves)
        before = len(calls)
        loss.backward()
        per_backward.append(len(calls) - before)
        return loss.detach()

    stats, direct = _compare(step, "aot_eager", leaves, steps=4)
    assert stats["captures"] == 1 and stats["cache_hits"] == 3 and direct == 3
    assert per_backward[-3:] == [0, 0, 0]  # torch's wrapper flattened each hit's 60 inputs with pytree


def test_a_callable_returning_torch_compile_is_direct_too(backend: str) -> None:
    model = make_mlp()

    def compiler(gm: torch.fx.GraphModule) -> Any:
        return torch.compile(gm, backend=backend)

    stats, direct = _compare(_mlp_step(model), compiler, model, steps=3)  # type: ignore[arg-type]
    assert stats["cache_hits"] == 2 and direct == 2


def test_a_failed_dynamo_guard_recompiles_the_normal_way(backend: str) -> None:
    """The thread count is in Dynamo's global-state guard, not in ca_core's key."""
    model = make_mlp()
    threads = torch.get_num_threads()

    def before(i: int) -> None:
        torch.set_num_threads(threads + 1 if i == 2 else threads)

    try:
        stats, direct = _compare(_mlp_step(model, before), backend, model, steps=4)
    finally:
        torch.set_num_threads(threads)
    assert stats["captures"] == 1 and stats["cache_hits"] == 3
    assert counters["stats"]["unique_graphs"] == 2  # step 2 recompiled in Dynamo
    assert direct == 2  # steps 1 and 3 (each finds its entry)


def test_dynamo_reset_is_honoured(backend: str) -> None:
    model = make_mlp()

    def before(i: int) -> None:
        if i == 2:
            torch._dynamo.reset()

    stats, direct = _compare(_mlp_step(model, before), backend, model, steps=4)
    assert stats["cache_hits"] == 3
    assert counters["stats"]["unique_graphs"] == 2  # the graph compiled again after the reset
    assert direct == 2


@pytest.mark.parametrize("stance", ["force_eager", "eager_on_recompile"])
def test_a_compile_stance_takes_the_normal_call(backend: str, stance: str) -> None:
    model = make_mlp()

    @contextlib_stance(stance)
    def step(i: int) -> torch.Tensor:
        return _mlp_step(model)(i)

    stats, direct = _compare(step, backend, model, steps=3)
    assert stats["cache_hits"] == 2
    assert direct == 0


def contextlib_stance(stance: str) -> Callable[[Callable[[int], Any]], Callable[[int], Any]]:
    """Runs steps 1 and later (the hits) under ``torch.compiler.set_stance(stance)``."""

    def wrap(step: Callable[[int], Any]) -> Callable[[int], Any]:
        def staged(i: int) -> Any:
            if i == 0:
                return step(i)
            with torch.compiler.set_stance(stance):
                return step(i)

        return staged

    return wrap


def test_a_global_module_hook_takes_the_normal_call(backend: str) -> None:
    model = make_mlp()
    calls: list[str] = []
    handles: list[Any] = []

    def before(i: int) -> None:
        if i == 1:
            handles.append(torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None))
        calls.append(str(i))

    try:
        stats, direct = _compare(_mlp_step(model, before), backend, model, steps=3)
    finally:
        for handle in handles:
            handle.remove()
    assert stats["cache_hits"] == 2
    assert direct == 0  # step 1 and 2 ran with the global hook registered (its removal is after step 2)


def test_a_dynamo_graph_break_is_not_direct(backend: str, cpp_ext: types.ModuleType) -> None:
    """An untraceable C++ Function: Dynamo's code calls it, then a resume function."""
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)

    def step(i: int) -> torch.Tensor:
        x.grad = w.grad = None
        out = cpp_ext.scaled_mul(x, w * 1.0, 0.5, False)
        out.pow(2).sum().backward()
        return out.detach()

    start = direct_calls()
    result = compare(step, backend, tensors=[x, w], steps=3)
    result.assert_ok()
    assert result.stats["graph_breaks"] > 0 and result.stats["cache_hits"] == 2
    assert result.stats["captures"] == 1 and result.stats["eager_fallbacks"] == 0, result.stats
    assert direct_calls() == start


def test_a_user_error_on_a_direct_hit_is_eagers(backend: str) -> None:
    """A hook that raises on a hit: the same error as eager, and the next hit is direct again.

    The hook reads ``raise_now``: Dynamo guards on it, so the raising step is
    a normal call that recompiles (the raise breaks Dynamo's graph, the hook
    runs eagerly). The step after it passes the guards of both entries and
    runs the first, fully traced one directly.
    """
    x = torch.randn(4, requires_grad=True)
    raise_now = [False]
    direct_per_step: list[int] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if raise_now[0]:
            raise ValueError("hook says no")
        return grad * 2

    def run(compiled: bool) -> list[str]:
        seen = []
        direct_per_step.clear()
        x.grad = None
        ctx = ca_runtime.enable(backend, capture_after=1) if compiled else ca_runtime.disable()
        with ctx:
            for i in range(4):
                raise_now[0] = i == 2
                y = x * 3
                y.register_hook(hook)
                before = direct_calls()
                try:
                    y.sum().backward()
                    seen.append(f"ok {x.grad.tolist()}")
                except ValueError as e:
                    seen.append(f"error {e}")
                direct_per_step.append(direct_calls() - before)
        return seen

    eager = run(False)
    ours = run(True)
    assert ours == eager and eager[2] == "error hook says no"
    # Steps 0 and 1 capture (x.grad is None, then defined); 2 and 3 are hits.
    stats = ca_runtime.stats()
    assert stats["captures"] == 2 and stats["cache_hits"] == 2 and stats["eager_fallbacks"] == 0, stats
    assert direct_per_step == [0, 0, 0, 1]


def _code_of(source: str) -> types.CodeType:
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # a test builds bytecode shaped like Dynamo's
    return namespace["forward"].__code__


def test_only_code_that_calls_one_graph_is_direct() -> None:
    one_graph = _code_of(
        "def forward(self, inputs, sizes, scalars, hooks):\n"
        "    out = __compiled_fn_1_x(inputs)\n"
        "    return [out[0], out[1], None]\n"
    )
    calls_a_hook = _code_of(
        "def forward(self, inputs, sizes, scalars, hooks):\n"
        "    out = __compiled_fn_1_x(inputs)\n"
        "    hooks[0](out[0])\n"
        "    return [out[0]]\n"
    )
    resumes = _code_of(
        "def forward(self, inputs, sizes, scalars, hooks):\n"
        "    out = __compiled_fn_1_x(inputs)\n"
        "    return __resume_at_10_2(out)\n"
    )
    two_graphs = _code_of(
        "def forward(self, inputs, sizes, scalars, hooks):\n"
        "    return [__compiled_fn_1_x(inputs), __compiled_fn_2_x(inputs)]\n"
    )
    stores = _code_of(
        "def forward(self, inputs, sizes, scalars, hooks):\n"
        "    out = __compiled_fn_1_x(inputs)\n"
        "    self.seen = out\n"
        "    return [out[0]]\n"
    )
    assert _runs_one_graph(one_graph)
    assert not _runs_one_graph(calls_a_hook)
    assert not _runs_one_graph(resumes)
    assert not _runs_one_graph(two_graphs)
    assert not _runs_one_graph(stores)


@pytest.fixture
def graph_module() -> Iterator[torch.fx.GraphModule]:
    yield torch.fx.symbolic_trace(torch.nn.Linear(2, 2))


def test_only_plain_torch_compile_of_the_graph_is_wrapped(graph_module: torch.fx.GraphModule) -> None:
    plain = torch.compile(graph_module, backend="eager")
    assert isinstance(wrap_if_dynamo_module(plain, graph_module), DirectDynamoCall)
    assert isinstance(
        wrap_if_dynamo_module(torch.compile(graph_module, backend="eager", dynamic=True), graph_module),
        DirectDynamoCall,
    )
    other = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert wrap_if_dynamo_module(plain, other) is plain  # compiles another module
    forward = graph_module.forward
    assert wrap_if_dynamo_module(forward, graph_module) is forward
    hooked = torch.compile(graph_module, backend="eager")
    hooked.register_forward_hook(lambda m, a, o: None)
    assert wrap_if_dynamo_module(hooked, graph_module) is hooked


def test_a_backward_inside_a_compiled_step(backend: str, recwarn: pytest.WarningsRecorder) -> None:
    """See [Note: Dynamo's callback during a compiled backward] in ca_core.

    Dynamo breaks the step's graph at ``backward()`` and runs it with its
    callback set: our machinery must not be traced as user code (Dynamo would
    warn that it cannot trace ``time.perf_counter``), the hits stay direct,
    and the callback is back for the rest of the step (Dynamo compiles its
    resume function as it does in eager).
    """
    model = make_mlp()

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach() * 2

    def graphs_of(compiled: bool) -> int:
        torch._dynamo.reset()
        counters.clear()
        step = torch.compile(train_step, backend="eager")
        with ca_runtime.enable(backend, capture_after=1) if compiled else ca_runtime.disable():
            for i in range(3):
                step(*batch(i))
        return int(counters["stats"]["unique_graphs"])

    def step_fn(i: int) -> torch.Tensor:
        return torch.compile(train_step, backend="eager")(*batch(i))

    stats, direct = _compare(step_fn, backend, model, steps=3)
    assert stats["captures"] == 1 and stats["cache_hits"] == 2 and direct == 2
    assert not [w for w in recwarn if "Dynamo does not know how to trace" in str(w.message)]
    # Eager's step: the graph before backward() and the resume function after
    # it; ours adds its one backward graph.
    assert graphs_of(True) == graphs_of(False) + 1


def test_a_profiled_direct_hit_keeps_dynamos_region(backend: str) -> None:
    model = make_mlp()
    step = _mlp_step(model)
    with ca_runtime.enable(backend, capture_after=1):
        step(0)
        start = direct_calls()
        with torch.profiler.profile() as prof:
            step(1)
    assert direct_calls() - start == 1
    names = [e.name for e in prof.events()]
    assert any(name.startswith("Torch-Compiled Region: ") for name in names)
    # The lookup that takes the place of Dynamo's own, with its time.
    assert names.count("ca: Dynamo guard check") == 1
    assert "TorchDynamo Cache Lookup" not in names


def _breakable(backend: str) -> tuple[Callable[[torch.fx.GraphModule], Any], list[bool], list[int]]:
    """A compiler whose Dynamo backend is ``backend`` until ``broken[0]`` is set, then raises; and its compile count."""
    broken, compiles = [False], [0]

    def breakable(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiles[0] += 1
        if broken[0]:
            raise RuntimeError("backend broke")
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return (lambda gm: torch.compile(gm, backend=breakable)), broken, compiles


def test_a_recompile_that_fails_on_a_hit_runs_the_graph_uncompiled(
    backend: str, recwarn: pytest.WarningsRecorder
) -> None:
    """See [Note: A recompile that fails on a hit]: eager's grads and hook calls, one warning, no second attempt.

    The hook's closure value changes at step 2: Dynamo's guard on it fails and
    the recompile fails. Steps 2 and 3 run the graph uncompiled (step 3 too:
    only the first entry exists, and its guard still fails).
    """
    x = torch.randn(4, requires_grad=True)
    compiler, broken, compiles = _breakable(backend)

    def step(i: int) -> list[Any]:
        calls: list[float] = []
        factor = 2.0 if i < 2 else 5.0
        broken[0] = i >= 2
        x.grad = None
        y = (x * 3).sin()

        def hook(grad: torch.Tensor) -> torch.Tensor:
            calls.append(factor)
            return grad * factor

        y.register_hook(hook)
        y.sum().backward()
        return [calls, x.grad.clone()]

    result = compare(step, compiler, tensors=[x], steps=4)
    result.assert_ok()
    stats = result.stats
    assert stats["captures"] == 1 and stats["cache_hits"] == 3 and stats["eager_fallbacks"] == 0, stats
    assert stats["uncompiled_runs"] == 2, stats
    assert compiles == [2]  # the first compile and the one failed recompile
    warned = [w for w in recwarn if "recompiling a cached backward graph failed" in str(w.message)]
    assert len(warned) == 1 and "backend broke" in str(warned[0].message)
    assert warned[0].filename == __file__  # the user's backward() line


def _fails_after_the_first_compile(backend: str) -> Callable[[torch.fx.GraphModule], Any]:
    """A compiler whose Dynamo backend is ``backend`` for the first frame Dynamo compiles, then raises."""
    compiles = [0]

    def fails_after_the_first(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        compiles[0] += 1
        if compiles[0] >= 2:
            raise RuntimeError("backend broke")
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return lambda gm: torch.compile(gm, backend=fails_after_the_first)


def test_a_recompile_that_fails_after_part_of_the_graph_ran_runs_that_part_uncompiled(
    backend: str, cpp_ext: types.ModuleType, recwarn: pytest.WarningsRecorder
) -> None:
    """See [Note: A later frame that fails to compile]: behind a Dynamo graph break (an untraceable
    C++ Function) the resume code recompiles after a hook ran and fails; it runs uncompiled, hooks once."""
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    compiler, broken, _ = _breakable(backend)
    factor = [2.0]

    def step(i: int) -> list[Any]:
        calls: list[str] = []
        factor[0] = 2.0 if i < 2 else 5.0  # Dynamo guards on it in the resume code only
        broken[0] = i >= 2
        x.grad = w.grad = None
        scaled = w * 1.0
        scaled.register_hook(lambda grad: calls.append("after") or grad * factor[0])
        out = cpp_ext.scaled_mul(x, scaled, 0.5, False)
        out.register_hook(lambda grad: calls.append("before") or grad)
        out.pow(2).sum().backward()
        return [calls, x.grad.clone(), w.grad.clone()]

    result = compare(step, compiler, steps=4)
    result.assert_ok()
    stats = result.stats
    assert stats["captures"] == 1 and stats["cache_hits"] == 3 and stats["eager_fallbacks"] == 0, stats
    assert stats["graph_breaks"] > 0
    warned = [w for w in recwarn if "behind a Dynamo graph break failed" in str(w.message)]
    assert len(warned) == 1 and "backend broke" in str(warned[0].message)
    assert warned[0].filename == __file__  # the user's backward() line


def test_a_hook_whose_own_frame_fails_to_compile_on_the_first_run_runs_uncompiled(
    backend: str, recwarn: pytest.WarningsRecorder
) -> None:
    """A hook with a Dynamo graph break inside is compiled as a frame of its own; its compile
    failing is no error of the user's: the hook runs once, uncompiled, and nothing runs twice."""

    def step(i: int) -> list[Any]:
        calls: list[str] = []
        w = torch.linspace(0.5, 1.5, 3, requires_grad=True)
        a = w * 2

        def hook(grad: torch.Tensor) -> torch.Tensor:
            calls.append("hook")
            torch._dynamo.graph_break()
            return grad * 3

        a.register_hook(hook)
        (a * a).sum().backward()
        return [calls, w.grad]

    result = compare(step, _fails_after_the_first_compile(backend), steps=3)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2, result.stats
    assert result.stats["eager_fallbacks"] == 0
    warned = [w for w in recwarn if "behind a Dynamo graph break failed" in str(w.message)]
    assert len(warned) == 1 and "backend broke" in str(warned[0].message)


def test_a_hook_reading_a_grad_whose_layout_changes_between_steps_stays_compiled(
    backend: str, recwarn: pytest.WarningsRecorder
) -> None:
    """See [Note: Later frames keep static strides]: a post-accumulate-grad hook behind a Dynamo graph
    break (``.item()``) reads ``p.grad``, which the step then points at a strided view. Dynamo's
    automatic dynamic stride failed to guard it (IndexError, so the hook ran uncompiled with
    aot_eager; with a warm Inductor cache, code for the old stride ran and asserted)."""
    p = torch.ones(2, 2, requires_grad=True)
    q = torch.full((2, 2), 0.5)
    sums: list[float] = []

    def hook(param: torch.Tensor) -> None:
        sums.append(param.grad.sum().item())

    p.register_post_accumulate_grad_hook(hook)

    def step(i: int) -> list[Any]:
        sums.clear()
        (p * q * (i + 1)).sum().backward()
        grad = p.grad.clone()
        p.grad.set_(torch.zeros(4, 2)[::2])  # the same .grad object, now strided
        return [list(sums), grad]

    result = compare(step, backend, tensors=[p], steps=4)
    result.assert_ok()
    assert result.stats["captures"] == 2 and result.stats["cache_hits"] == 2, result.stats
    assert result.stats["eager_fallbacks"] == 0 and result.stats["uncompiled_runs"] == 0, result.stats
    assert result.stats["graph_breaks"] == 0, result.stats  # Dynamo's break is inside the hook, not ours
    assert not [w for w in recwarn if "ca_runtime" in str(w.message)]
    # The hook's frame compiled once per layout it saw (contiguous, strided), both kept.
    assert len(_torch_interop.dynamo_cache_entries(hook.__code__)) == 2


def test_a_resume_frame_that_fails_on_the_first_run_does_not_run_hooks_twice(
    backend: str, recwarn: pytest.WarningsRecorder
) -> None:
    """Behind our graph break (retain_grad's C++ hook), the first run's resume code fails to compile."""

    def step(i: int) -> list[Any]:
        calls: list[str] = []
        w = torch.linspace(0.5, 1.5, 3, requires_grad=True)
        a = w * 2
        a.retain_grad()
        b = a * 3
        b.register_hook(lambda grad: calls.append("before") or grad)
        a.register_hook(lambda grad: calls.append("after") or grad * 2)
        (b * b).sum().backward()
        return [calls, w.grad, a.grad]

    result = compare(step, _fails_after_the_first_compile(backend), steps=2)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["graph_breaks"] > 0, result.stats
    assert result.stats["eager_fallbacks"] == 0
    warned = [w for w in recwarn if "behind a Dynamo graph break failed" in str(w.message)]
    assert len(warned) == 1
