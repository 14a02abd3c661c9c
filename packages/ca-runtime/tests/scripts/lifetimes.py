"""Programs that once crashed the process: each runs as ``python lifetimes.py NAME [N]``.

Run in a fresh process (under PYTHONMALLOC=debug and faulthandler by
tests/test_lifetimes.py), so that a use-after-free is a crash there and
nothing else a test did can hide it. Each prints ``ok`` and its results on
stdout; anything on stderr (a fault, "Exception ignored in", a warning at
exit) fails the test.
"""

from __future__ import annotations

import gc
import sys
import threading
import time

import ca_runtime
import torch

torch.set_num_threads(1)


class SelfKeepingCompiler:
    """A compiler whose compiled callables keep it alive: clearing the cache kills it."""

    def __call__(self, gm: torch.fx.GraphModule):
        fn = torch.compile(gm, backend="aot_eager")

        def run(*args, _owner=self, **kwargs):
            return fn(*args, **kwargs)

        return run


def reset_kills_the_compiler() -> None:
    """issue 34's first program: reset() drops the graphs, the compiler dies, its cache is dropped."""
    m = torch.nn.Linear(4, 4)
    with ca_runtime.enable(SelfKeepingCompiler(), capture_after=1):
        m(torch.randn(2, 4)).sum().backward()
    captured = ca_runtime.stats()["captures"] - ca_runtime.stats()["eager_fallbacks"]
    ca_runtime.reset()
    print("ok", captured, ca_runtime.cache_info())


def compiler_cached_at_exit() -> None:
    """A compiler kept alive by its own graphs until the interpreter exits."""
    m = torch.nn.Linear(4, 4)
    with ca_runtime.enable(SelfKeepingCompiler(), capture_after=1):
        m(torch.randn(2, 4)).sum().backward()
        m.zero_grad()
        m(torch.randn(2, 4)).sum().backward()
    print("ok", ca_runtime.stats()["cache_hits"])


def reset_inside_a_backward() -> None:
    """A hook calls reset() mid-backward while the compiler's graphs keep it alive."""
    x = torch.randn(4, requires_grad=True)

    def hook(g: torch.Tensor) -> torch.Tensor:
        ca_runtime.reset()
        gc.collect()
        return g

    with ca_runtime.enable(SelfKeepingCompiler(), capture_after=1):
        for _ in range(3):
            y = x * 2
            y.register_hook(hook)
            (y * y).sum().backward()
    # eager: three backwards of (2x)^2; each captured (reset() mid-backward empties the cache)
    print("ok", torch.allclose(x.grad, 3 * 8 * x.detach()), ca_runtime.stats()["eager_fallbacks"])


def exit_while_another_thread_backwards() -> None:
    """issue 34's second program: enable() exits while a worker's hook sleeps in its backward."""
    in_hook = threading.Event()
    grads: list[list[float]] = []

    def slow_hook(g: torch.Tensor) -> torch.Tensor:
        in_hook.set()
        time.sleep(0.3)
        return g

    def worker() -> None:
        x = torch.ones(4, requires_grad=True)
        y = x * 2
        y.register_hook(slow_hook)
        y.sum().backward()
        grads.append(x.grad.tolist())

    t = threading.Thread(target=worker)
    with ca_runtime.enable(lambda gm: gm, capture_after=1):
        t.start()
        in_hook.wait()
    t.join()
    gc.collect()
    stats = ca_runtime.stats()
    print("ok", grads, stats["captures"], stats["eager_fallbacks"])


def exit_during_a_slow_compile() -> None:
    """enable() exits on the main thread while the worker's compiler_fn is still compiling."""
    compiling = threading.Event()
    grads: list[list[float]] = []

    def slow_compiler(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        compiling.set()
        time.sleep(0.3)
        return gm

    def worker() -> None:
        x = torch.ones(4, requires_grad=True)
        (x * 3).sum().backward()
        grads.append(x.grad.tolist())

    t = threading.Thread(target=worker)
    with ca_runtime.enable(slow_compiler, capture_after=1):
        t.start()
        compiling.wait()
    del slow_compiler
    t.join()
    gc.collect()
    stats = ca_runtime.stats()
    print("ok", grads, stats["captures"], stats["eager_fallbacks"])


def compilers_made_and_dropped(cycles: int) -> None:
    """Compilers made and dropped while backwards run on two threads, a reset() now and then."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def backwards(seed: int) -> None:
        torch.manual_seed(seed)
        m = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4)
        try:
            while not stop.is_set():
                m(x).sum().backward()
        except BaseException as e:  # reported below: the test reads stdout
            errors.append(e)

    threads = [threading.Thread(target=backwards, args=(i,)) for i in range(2)]
    with ca_runtime.enable("eager", capture_after=1):
        for t in threads:
            t.start()
        for i in range(cycles):
            compiler = SelfKeepingCompiler() if i % 3 == 0 else (lambda gm: gm)
            with ca_runtime.enable(compiler, capture_after=1):
                torch.nn.Linear(3, 3)(torch.randn(1, 3)).sum().backward()
            del compiler
            if i % 7 == 0:
                gc.collect()
            if i % 10 == 9:
                ca_runtime.reset()
        stop.set()
        for t in threads:
            t.join()
    print("ok", [repr(e) for e in errors])


PROGRAMS = {
    f.__name__: f
    for f in (
        reset_kills_the_compiler,
        compiler_cached_at_exit,
        reset_inside_a_backward,
        exit_while_another_thread_backwards,
        exit_during_a_slow_compile,
    )
}

if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore", ca_runtime.RecompileWarning)
    if sys.argv[1] == "compilers_made_and_dropped":
        compilers_made_and_dropped(int(sys.argv[2]))
    else:
        PROGRAMS[sys.argv[1]]()
