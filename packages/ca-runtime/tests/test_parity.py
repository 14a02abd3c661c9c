"""Eager parity: one cache per compiler, and user errors that change nothing."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import ca_runtime
import pytest
import torch
from ca_testkit import compare

# --- the cache knows its compiler (see [Note: One cache per compiler]) ---


def test_each_compiler_has_its_own_cache() -> None:
    calls: list[str] = []

    def compiler_a(gm: torch.fx.GraphModule):
        calls.append("a")
        return gm

    def compiler_b(gm: torch.fx.GraphModule):
        calls.append("b")
        return gm

    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    lin(x).sum().backward()  # .grad defined from here on: one key path throughout
    for compiler in (compiler_a, compiler_b, compiler_a, "eager", "eager"):
        with ca_runtime.enable(compiler, capture_after=1):
            lin.zero_grad(set_to_none=False)
            lin(x).sum().backward()
    assert calls == ["a", "b"]  # the second compiler_a backward is a hit
    stats = ca_runtime.stats()
    assert stats["captures"] == 3 and stats["cache_hits"] == 2, stats
    by_compiler = {e.compiler: e.hits for e in ca_runtime.cache_info()}
    assert by_compiler["backend:eager"] == 1
    assert sorted(by_compiler[k] for k in by_compiler if k.startswith("callable:")) == [0, 1]


# A dead compiler's cache and compilers made anew: tests/test_compiler_keys.py.


@pytest.mark.inductor
def test_aot_eager_then_inductor_compiles_with_inductor() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        model(x).sum().backward()

    for backend in ("aot_eager", "inductor"):
        result = compare(step, backend, tensors=model, steps=1)
        result.assert_ok()
    with ca_runtime.enable("aot_eager", capture_after=1):
        step()
    with ca_runtime.enable("inductor", capture_after=1):
        step()
    compilers = {e.compiler for e in ca_runtime.cache_info()}
    assert compilers == {"backend:aot_eager", "backend:inductor"}
    assert ca_runtime.stats()["captures"] == 2


# --- user errors change nothing (see [Note: Whose failure]) ---


class _Doubles(torch.autograd.Function):
    """x * 2; with ``too_many`` its backward returns one grad more than it has inputs."""

    @staticmethod
    def forward(ctx, x, too_many: bool):  # type: ignore[override]
        ctx.too_many = too_many
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return (grad * 2, None, grad) if ctx.too_many else (grad * 2, None)


def _backward_twice(w: torch.Tensor, mistake: bool) -> None:
    loss = (w * w).sin().sum()
    loss.backward()
    if mistake:
        loss.backward()


def _modified_in_place(w: torch.Tensor, mistake: bool) -> None:
    y = w.sin()
    z = y * y
    if mistake:
        y.add_(1)
    z.sum().backward()


def _hook_raises_inside_torch(w: torch.Tensor, mistake: bool) -> None:
    y = w * 2
    y.register_hook(lambda g: torch.nn.functional.softmax(g, dim=5 if mistake else 0))
    y.sum().backward()


def _hook_raises(w: torch.Tensor, mistake: bool) -> None:
    def hook(g: torch.Tensor) -> torch.Tensor:
        if mistake:
            raise ValueError("the user's hook refuses")
        return g

    y = w * 2
    y.register_hook(hook)
    y.sum().backward()


def _hook_changes_shape(w: torch.Tensor, mistake: bool) -> None:
    y = w * 2
    y.register_hook(lambda g: g[:2] if mistake else g * 1)
    y.sum().backward()


def _function_returns_too_many(w: torch.Tensor, mistake: bool) -> None:
    _Doubles.apply(w, mistake).sum().backward()


MISTAKES: dict[str, Callable[[torch.Tensor, bool], None]] = {
    "backward twice": _backward_twice,
    "saved tensor modified in place": _modified_in_place,
    "hook raises inside torch": _hook_raises_inside_torch,
    "hook raises": _hook_raises,
    "hook changes the grad's shape": _hook_changes_shape,
    "Function returns too many grads": _function_returns_too_many,
}


def _error_of(fn: Callable[[], None]) -> tuple[str, str]:
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value).__name__, str(info.value).splitlines()[0]


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_user_error_raises_eagers_error_and_changes_nothing(backend: str, mistake: str) -> None:
    step = MISTAKES[mistake]
    with ca_runtime.disable():
        eager_error = _error_of(lambda: step(torch.randn(3, requires_grad=True), True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ca_runtime.EagerFallbackWarning)
        with ca_runtime.enable(backend, capture_after=1):
            assert _error_of(lambda: step(torch.randn(3, requires_grad=True), True)) == eager_error
            after_error = ca_runtime.stats()
            # The same program without the mistake: captured or served, never eager.
            for _ in range(2):
                step(torch.randn(3, requires_grad=True), False)
    stats = ca_runtime.stats()
    assert stats["eager_fallbacks"] == 0, stats
    assert stats["captures"] + stats["cache_hits"] >= after_error["captures"] + after_error["cache_hits"] + 2
    assert not any(e.failed for e in ca_runtime.cache_info()), ca_runtime.cache_info()


def test_failed_entries_show_their_reason_and_can_be_retried() -> None:
    def broken(gm: torch.fx.GraphModule):
        raise RuntimeError("this compiler is broken today")

    x = torch.randn(3, requires_grad=True)
    with pytest.warns(ca_runtime.EagerFallbackWarning), ca_runtime.enable(broken, capture_after=1):
        (x * 2).sum().backward()
    (entry,) = ca_runtime.cache_info()
    assert entry.failed and "this compiler is broken today" in entry.failure, entry
    ca_runtime.cache_clear_failed()
    assert not any(e.failed for e in ca_runtime.cache_info())


# --- anomaly mode (see [Note: Anomaly mode]) ---


def _nan_backward() -> None:
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    (x.sqrt() / x).sum().backward()  # 0/0 in DivBackward0


def test_anomaly_mode_raises_eagers_error_naming_the_node(backend: str) -> None:
    with ca_runtime.disable(), torch.autograd.detect_anomaly(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager_error = _error_of(_nan_backward)
    assert "DivBackward0" in eager_error[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # detect_anomaly's own notice and traceback
        warnings.simplefilter("error", ca_runtime.EagerFallbackWarning)
        with ca_runtime.enable(backend, capture_after=1):
            with torch.autograd.detect_anomaly():
                assert _error_of(_nan_backward) == eager_error
            assert ca_runtime.stats()["eager_fallbacks"] == 1
            w = torch.randn(3, requires_grad=True)
            (w * 2).sum().backward()  # out of anomaly mode: compiled again
    stats = ca_runtime.stats()
    assert stats["captures"] == 1 and stats["eager_fallbacks"] == 1, stats


# --- warnings raised during the backward ---


class _WarnsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        warnings.warn("backward of _WarnsInBackward says hi")
        return grad * 2


def test_a_warning_from_the_backward_reaches_the_user_once_per_backward(backend: str) -> None:
    def three_steps() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                w = torch.randn(3, requires_grad=True)
                _WarnsInBackward.apply(w).sum().backward()
        return [str(c.message) for c in caught if "_WarnsInBackward" in str(c.message)]

    with ca_runtime.disable():
        eager = three_steps()
    with ca_runtime.enable(backend, capture_after=1):
        ours = three_steps()
    assert ours == eager == ["backward of _WarnsInBackward says hi"] * 3
    stats = ca_runtime.stats()
    assert stats["captures"] >= 1 and stats["eager_fallbacks"] == 0, stats


# --- lifetimes of saved tensors ---


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def _saved_after_backward(retain_graph: bool) -> list[str]:
    x = torch.randn(3, requires_grad=True)
    y = _Square.apply(x * 1)
    h = (x * 2).exp()  # ExpBackward0 saves its result
    ctx, exp_node = y.grad_fn, h.grad_fn
    (y.sum() + h.sum()).backward(retain_graph=retain_graph)
    seen = []
    for name, read in (
        ("ctx.saved_tensors", lambda: ctx.saved_tensors),
        ("_saved_result", lambda: exp_node._saved_result),
    ):
        try:
            read()
            seen.append(f"{name}: alive")
        except RuntimeError as e:
            seen.append(f"{name}: {str(e).splitlines()[0]}")
    return seen


@pytest.mark.parametrize("retain_graph", [False, True])
def test_saved_tensors_are_freed_as_eager_frees_them(backend: str, retain_graph: bool) -> None:
    with ca_runtime.disable():
        eager = _saved_after_backward(retain_graph)
    with ca_runtime.enable(backend, capture_after=1):
        ours = [_saved_after_backward(retain_graph) for _ in range(2)]
    assert ours == [eager, eager]
    assert all(s.endswith("alive") for s in eager) == retain_graph
    stats = ca_runtime.stats()
    assert stats["captures"] >= 1 and stats["eager_fallbacks"] == 0, stats


def test_linalg_lstsq_complex_grad_equals_eager(backend: str) -> None:
    """The sweep's one mismatch: AOTAutograd gets this backward wrong, so it runs behind a graph break."""
    torch.manual_seed(0)
    a = torch.randn(2, 3, dtype=torch.complex64)
    b = torch.randn(2, 3, dtype=torch.complex64)
    a = torch.linalg.qr(a.mH).Q.mH.contiguous()  # well conditioned
    ref = None
    for compiled in (False, True):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        ctx = ca_runtime.enable(backend, capture_after=1) if compiled else contextlib.nullcontext()
        with ctx:
            out = torch.linalg.lstsq(x, y, driver="gels").solution
            (out.real.sum() + out.imag.sum()).backward()
        if ref is None:
            ref = (x.grad, y.grad)
        else:
            assert torch.allclose(x.grad, ref[0], atol=1e-4) and torch.allclose(y.grad, ref[1], atol=1e-4)
    assert ca_runtime.stats()["captures"] == 1 and ca_runtime.stats()["graph_breaks"] == 1
