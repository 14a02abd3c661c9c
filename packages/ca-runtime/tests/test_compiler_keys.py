"""Which cache a compiler_fn uses: compilers made anew find their captures; see [Note: Compilers made anew].

Each differential test makes its compiler inside the step, as a training
loop written in torch's style does (``with enable(lambda gm: ...)`` per
step); ``made_anew_each_step`` enters it only while ca_testkit's compiled
run is on, so the eager run stays eager.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import ca_core
import ca_runtime
import pytest
import torch
from ca_testkit import compare

STEPS = 4


def _mlp() -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model, [torch.randn(3, 4) for _ in range(STEPS)]


@contextlib.contextmanager
def made_anew_each_step(make: Callable[[], object]) -> Iterator[None]:
    """``enable(make())`` when ca is on (compare()'s compiled run), nothing in its eager run."""
    if ca_core.installed_runtime() is None:
        yield
        return
    with ca_runtime.enable(make(), capture_after=1):  # type: ignore[arg-type]
        yield


def _training_loop(make: Callable[[], object]) -> tuple[Callable[[int], torch.Tensor], torch.nn.Module]:
    model, xs = _mlp()

    def step(i: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)  # as an optimizer's zero_grad: one key path every step
        with made_anew_each_step(make):
            loss = model(xs[i]).pow(2).sum()
            loss.backward()
        return loss.detach()

    return step, model


def _compile_with(backend: str) -> Callable[[torch.fx.GraphModule], Any]:
    def compiler(gm: torch.fx.GraphModule) -> Any:
        return torch.compile(gm, backend=backend)

    return compiler


def _compile(gm: torch.fx.GraphModule, backend: str, fullgraph: bool = False) -> Any:
    return torch.compile(gm, backend=backend, fullgraph=fullgraph)


#: Ways user code makes "the same" compiler again each step.
EQUIVALENT_REMAKES: dict[str, Callable[[str], Callable[[], object]]] = {
    "lambda": lambda backend: lambda: lambda gm: torch.compile(gm, backend=backend),
    "nested function": lambda backend: lambda: _compile_with(backend),
    "partial": lambda backend: lambda: functools.partial(_compile, backend=backend),
    "partial of a nested function": lambda backend: lambda: functools.partial(_compile_with(backend)),
}


@pytest.mark.parametrize("remake", list(EQUIVALENT_REMAKES), ids=list(EQUIVALENT_REMAKES))
def test_a_compiler_made_anew_each_step_finds_its_captures(backend: str, remake: str) -> None:
    step, model = _training_loop(EQUIVALENT_REMAKES[remake](backend))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ca_runtime.RecompileWarning)
        result = compare(step, "eager", tensors=model, steps=STEPS)
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == STEPS - 1, result.stats
    assert [e.compiler.startswith("callable:") for e in ca_runtime.cache_info()] == [True]


def test_compilers_that_differ_in_a_value_compile_apart() -> None:
    """A closure over another backend name is another compiler: its own cache, no warning."""
    backends = ["eager", "aot_eager", "eager", "aot_eager"]
    step, model = _training_loop(lambda: _compile_with(backends.pop(0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ca_runtime.RecompileWarning)
        result = compare(step, "eager", tensors=model, steps=STEPS)
    result.assert_ok()
    assert result.stats["captures"] == 2 and result.stats["cache_hits"] == 2, result.stats
    assert len({e.compiler for e in ca_runtime.cache_info()}) == 2


def test_a_new_object_in_the_closure_recompiles_and_warns_once(backend: str) -> None:
    def make() -> Callable[[torch.fx.GraphModule], Any]:
        calls: list[int] = []  # a new list each step: compared by identity

        def compiler(gm: torch.fx.GraphModule) -> Any:
            calls.append(1)
            return torch.compile(gm, backend=backend)

        return compiler

    step, model = _training_loop(make)
    with pytest.warns(ca_runtime.RecompileWarning) as caught:
        result = compare(step, "eager", tensors=model, steps=STEPS)
    result.assert_ok()
    assert result.stats["captures"] == STEPS and result.stats["cache_hits"] == 0, result.stats
    recompiles = [w for w in caught if issubclass(w.category, ca_runtime.RecompileWarning)]
    assert len(recompiles) == 1, [str(w.message) for w in recompiles]
    text = str(recompiles[0].message)
    assert "make.<locals>.compiler" in text and "closure variable 'calls' (a new list)" in text, text
    assert "Create the compiler once, outside the loop" in text
    assert recompiles[0].filename == __file__  # the user's backward() line, not torch's


def test_a_compiler_object_drops_its_cache_when_it_dies() -> None:
    class Compiler:
        def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
            return gm

    lin = torch.nn.Linear(3, 2)
    compiler = Compiler()
    with ca_runtime.enable(compiler, capture_after=1):
        lin(torch.randn(2, 3)).sum().backward()
    assert [e.compiler.startswith("callable:") for e in ca_runtime.cache_info()] == [True]
    del compiler
    gc.collect()
    assert [e for e in ca_runtime.cache_info() if e.compiler.startswith("callable:")] == []


def test_a_lambdas_cache_outlives_the_lambda() -> None:
    """Its code lives on (it is a constant of this function's code): a lambda made again finds the entry."""
    lin = torch.nn.Linear(3, 2)
    for _ in range(2):
        with ca_runtime.enable(lambda gm: gm, capture_after=1):
            lin(torch.randn(2, 3)).sum().backward()
        lin.grad = None
        for p in lin.parameters():
            p.grad = None
        gc.collect()
    stats = ca_runtime.stats()
    assert stats["captures"] == 1 and stats["cache_hits"] == 1, stats


def test_a_dead_anchor_in_a_closure_drops_the_key() -> None:
    """A closure over an object compared by identity: when it dies, so does the cache it keyed.

    (An object that the compiled graph itself keeps alive, such as a backend
    object passed to torch.compile, lives as long as the cache: until reset().)
    """

    class Settings:
        backend = "eager"

    def make(settings: Settings) -> Callable[[torch.fx.GraphModule], Any]:
        return lambda gm: torch.compile(gm, backend=settings.backend)

    lin = torch.nn.Linear(3, 2)
    settings = Settings()
    with ca_runtime.enable(make(settings), capture_after=1):
        lin(torch.randn(2, 3)).sum().backward()
    assert len(ca_runtime.cache_info()) == 1
    del settings
    gc.collect()
    assert ca_runtime.cache_info() == []


def test_a_compiler_dying_during_another_capture_keeps_that_capture() -> None:
    """Only the dead compiler's tree is dropped: the capture in flight is stored (a hit next)."""

    class Doomed:
        def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
            return gm

    lin = torch.nn.Linear(3, 2)
    lin(torch.randn(2, 3)).sum().backward()
    doomed = [Doomed()]
    with ca_runtime.enable(doomed[0], capture_after=1):
        lin(torch.randn(2, 3)).sum().backward()

    def compiler_fn(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        doomed.clear()  # the other compiler dies while this backward captures
        gc.collect()
        return gm

    xs = [torch.randn(2, 3) for _ in range(3)]
    result = compare(lambda i: lin(xs[i]).sum().backward(), compiler_fn, tensors=lin, steps=3)
    result.assert_ok()
    assert not doomed
    assert result.stats["captures"] == 1 and result.stats["cache_hits"] == 2, result.stats
    assert len(ca_runtime.cache_info()) == 1


def test_runtime_shows_the_compiler_the_user_passed() -> None:
    def compiler(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return gm

    with ca_runtime.enable("aot_eager", capture_after=1) as runtime:
        assert runtime.compiler_fn == "aot_eager"
    with ca_runtime.enable(compiler, capture_after=1) as runtime:
        assert runtime.compiler_fn is compiler
