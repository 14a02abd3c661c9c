"""Never a segfault: what a backward or the cache uses stays alive while it is used.

See [Note: What the cache lets go of] and [Note: Engine hook lifetime] in
ca_core. Each program runs in a fresh process under ``PYTHONMALLOC=debug``
and faulthandler (tests/scripts/lifetimes.py): a use-after-free crashes it
there, and its stderr must be empty (no fault, no "Exception ignored in" at
exit). The gradients each prints are eager's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
import weakref
from pathlib import Path

import ca_core
import ca_runtime
import pytest
import torch

SCRIPT = Path(__file__).parent / "scripts" / "lifetimes.py"


def _run(*args: str, timeout: float = 240) -> str:
    env = {**os.environ, "PYTHONMALLOC": "debug", "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert done.returncode == 0 and done.stderr == "", (done.returncode, done.stderr[-3000:])
    assert done.stdout.startswith("ok"), done.stdout
    return done.stdout.strip()


def test_reset_that_kills_the_compiler_its_graphs_held() -> None:
    assert _run("reset_kills_the_compiler") == "ok 1 []"  # captured, then emptied


def test_a_compiler_still_cached_at_exit_prints_nothing() -> None:
    assert _run("compiler_cached_at_exit") == "ok 1"


def test_reset_inside_a_backward() -> None:
    assert _run("reset_inside_a_backward") == "ok True 0"


@pytest.mark.parametrize("program", ["exit_while_another_thread_backwards", "exit_during_a_slow_compile"])
def test_enable_exits_while_a_backward_is_in_flight(program: str) -> None:
    expected = [[2.0] * 4] if "thread" in program else [[3.0] * 4]
    # The worker's backward was captured and compiled (1 capture, no fallback).
    assert _run(program) == f"ok {expected} 1 0"


def test_compilers_made_and_dropped_while_two_threads_backward() -> None:
    assert _run("compilers_made_and_dropped", "150", timeout=400) == "ok []"


def test_no_node_run_plan_or_graph_source_outlives_reset(backend: str) -> None:
    """What a capture registers beside its graph is released with it (issue 34: memory reset() kept)."""
    from torch.fx.graph_module import _loader

    x = torch.randn(8, requires_grad=True)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(30):
            y = (y * 1.01).sin()
        return y.sum()

    with ca_runtime.enable(lambda gm: gm, capture_after=1):
        chain().backward()
    ca_runtime.reset()
    import gc

    gc.collect()
    plans, sources = ca_core.live_node_run_plans(), len(_loader.eval_cache)
    for _ in range(3):
        with ca_runtime.enable(lambda gm: gm, capture_after=1):
            chain().backward()
        assert ca_core.live_node_run_plans() > plans  # the capture fused runs of nodes
        ca_runtime.reset()
        gc.collect()
    assert ca_core.live_node_run_plans() == plans
    assert len(_loader.eval_cache) == sources


def test_no_dynamo_guard_set_or_cache_entry_outlives_reset(backend: str) -> None:
    """See [Note: What Dynamo keeps of a dropped graph]: the graphs' guard managers and cache entries go with reset().

    So do the ShapeEnvs of their compiles ([Note: Fakes a finished compile
    still tracks]), torch.compile's backend wrappers, the sources of the
    graph modules Dynamo made on the first runs, the graphs' code objects and
    the stacks Dynamo's metrics recorded ([Note: Stacks Dynamo's metrics keep]).
    """
    import gc

    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.eval_frame import cached_backends
    from torch._dynamo.guards import CheckFunctionManager
    from torch._dynamo.utils import get_metrics_context
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.fx.graph_module import _loader

    x = torch.randn(8, requires_grad=True)
    codes: list[weakref.ref[types.CodeType]] = []

    def compiler(gm: torch.fx.GraphModule) -> object:
        codes.append(weakref.ref(type(gm).forward.__code__))
        return torch.compile(gm, backend=backend)

    def managers() -> int:
        gc.collect()
        return sum(type(o) is CheckFunctionManager for o in gc.get_objects())

    def shape_envs() -> int:
        gc.collect()
        return sum(type(o) is ShapeEnv for o in gc.get_objects())

    def backends() -> int:
        return sum(b is not None for b in cached_backends.values())

    ca_runtime.reset()
    before = managers()
    envs = backends_before = sources = stacks = -1
    for i in range(4):
        if i == 1:  # after one capture: what torch makes once per process is there
            envs, backends_before, sources = shape_envs(), backends(), len(_loader.eval_cache)
            stacks = len(get_metrics_context()._edits)
        with ca_runtime.enable(compiler, capture_after=1):
            y = x
            for _ in range(10):
                y = (y * 1.01).sin()
            y.sum().backward()
            assert ca_runtime.stats()["captures"] == 1
        assert managers() > before  # the capture compiled in Dynamo
        code = codes[-1]()
        assert code is not None and _debug_get_cache_entry_list(code)
        ca_runtime.reset()
        assert not _debug_get_cache_entry_list(code)
        del code
    assert managers() == before
    assert shape_envs() == envs
    assert backends() == backends_before
    assert len(_loader.eval_cache) == sources
    assert len(get_metrics_context()._edits) == stacks
    assert [ref() for ref in codes] == [None] * 4


def test_a_fallback_is_reported_to_the_backwards_own_runtime_after_enable_exits() -> None:
    """The worker's first run fails after the main thread left enable(): its runtime still warns and records."""
    import threading
    import time

    from ca_runtime._report.records import RECORDER

    started = threading.Event()

    def failing_compiler(gm: torch.fx.GraphModule):
        def run(*args: object) -> object:
            started.set()
            time.sleep(0.3)
            raise RuntimeError("the compiled graph fails")

        return run

    grads: list[torch.Tensor] = []
    caught: list[str] = []

    def worker() -> None:
        import warnings

        x = torch.ones(4, requires_grad=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            (x * 3).sum().backward()
        caught.extend(str(w.message) for w in seen if issubclass(w.category, ca_runtime.EagerFallbackWarning))
        grads.append(x.grad)

    t = threading.Thread(target=worker)
    with ca_runtime.enable(failing_compiler, capture_after=1):
        t.start()
        started.wait()
    t.join()
    assert ca_core.installed_runtime() is None
    assert torch.equal(grads[0], torch.full((4,), 3.0))
    assert ca_runtime.stats()["eager_fallbacks"] == 1
    assert RECORDER.snapshot().num_fallbacks == 1
    assert caught and "the compiled graph fails" in caught[0], caught
