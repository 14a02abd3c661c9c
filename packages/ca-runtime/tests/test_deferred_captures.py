"""Captures that wait: ``enable(capture_after=N)`` (default 2) and backwards gradcheck runs.

See [Note: Which captures wait] (ca_runtime) and [Note: Deferred captures]
(ca_core). Eager autograd is the oracle: a deferred backward runs on the
eager engine, so its grads, ``.grad`` and hook calls are eager's; the later
ones are captured and served from the cache as without the option.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import ca_runtime
import pytest
import torch
from ca_testkit import compare

BACKENDS = ("eager", "aot_eager")


def _step(i: int) -> Any:
    """A training-like step with fresh leaves (one key path every step), a tensor hook and a post-accumulate hook."""
    gen = torch.Generator().manual_seed(i)
    w = torch.randn(4, 3, generator=gen).requires_grad_()
    x = torch.randn(5, 4, generator=gen)
    calls: list[str] = []

    def doubled(g: torch.Tensor) -> torch.Tensor:
        calls.append("tensor")
        return g * 2

    def halve_grad(p: torch.Tensor) -> None:
        calls.append("post-acc")
        p.grad.mul_(0.5)

    h = (x @ w).tanh()
    h.register_hook(doubled)
    w.register_post_accumulate_grad_hook(halve_grad)
    (h.square().sum() + w.sin().sum()).backward()
    return w.grad, torch.tensor(len(calls)), torch.tensor(calls.index("post-acc"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_capture_after_2_runs_the_first_backward_eagerly_then_captures_and_hits(backend: str) -> None:
    result = compare(_step, backend, steps=4, impl="ca-capture-after-2")
    result.assert_ok()
    stats = result.stats
    assert (stats["deferred_captures"], stats["captures"], stats["cache_hits"]) == (1, 1, 2), stats
    assert stats["eager_fallbacks"] == 0, stats


@pytest.mark.parametrize("backend", BACKENDS)
def test_capture_after_1_captures_at_once(backend: str) -> None:
    result = compare(_step, backend, steps=3)  # impl "ca": see [Note: Differential runs capture at once]
    result.assert_ok()
    stats = result.stats
    assert (stats["deferred_captures"], stats["captures"], stats["cache_hits"]) == (0, 1, 2), stats


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_default_captures_a_graph_on_its_second_backward(backend: str) -> None:
    """``enable(backend)`` as a user writes it: a backward that runs once is never compiled, a loop is from step 2."""
    with ca_runtime.disable():
        eager = [_step(i) for i in range(4)]
    ca_runtime.reset()
    with ca_runtime.enable(backend):
        ours = [_step(0)]
        assert ca_runtime.stats()["captures"] == 0 and ca_runtime.stats()["deferred_captures"] == 1
        ours += [_step(i) for i in range(1, 4)]
    stats = ca_runtime.stats()
    assert (stats["deferred_captures"], stats["captures"], stats["cache_hits"]) == (1, 1, 2), stats
    assert stats["eager_fallbacks"] == 0, stats
    for step_eager, step_ours in zip(eager, ours, strict=True):
        for e, o in zip(step_eager, step_ours, strict=True):
            assert torch.equal(e, o)


def test_torchs_own_backend_names_are_accepted_without_importing_every_backend() -> None:
    """A program whose backwards all run before their capture never imports AOTAutograd (about 0.4 s)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import sys, torch, ca_runtime
        x = torch.ones(3, requires_grad=True)
        for backend in ("eager", "aot_eager", "inductor"):
            with ca_runtime.enable(backend):
                (x * x).sum().backward()
        assert ca_runtime.stats()["deferred_captures"] == 3, ca_runtime.stats()
        print("aot_autograd imported:", "torch._functorch.aot_autograd" in sys.modules)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "aot_autograd imported: False", run.stdout


def _mlp_backward(depth: int, width: int, batch: int = 8) -> Any:
    """One backward of a fresh tanh MLP (2 -> width x depth -> 1): a notebook cell."""
    gen = torch.Generator().manual_seed(depth * 100 + width)
    sizes = [2] + [width] * depth + [1]
    weights = [
        torch.randn(a, b, generator=gen).mul_(0.5).requires_grad_() for a, b in itertools.pairwise(sizes)
    ]
    h = torch.randn(batch, 2, generator=gen)
    for i, w in enumerate(weights):
        h = h @ w
        if i + 1 < len(weights):
            h = h.tanh()
    h.square().mean().backward()
    return [w.grad for w in weights]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_tried_at_several_sizes_once_each_is_never_captured(backend: str) -> None:
    """The notebook of [Note: Which captures wait]: depths 2-5 x widths 16 and 32, one backward each.

    A third width of a depth would be captured: see the loop below, whose sizes change every step.
    """
    cells = [(depth, width) for depth in (2, 3, 4, 5) for width in (16, 32)]
    result = compare(
        lambda i: _mlp_backward(*cells[i]),
        backend,
        steps=len(cells),
        impl="ca-capture-after-2",
        expect_capture=False,
    )
    result.assert_ok()
    stats = result.stats
    # Every backward ran through ca's engine hook and chose the eager engine.
    assert (stats["captures"], stats["cache_hits"], stats["deferred_captures"]) == (0, 0, len(cells)), stats
    assert stats["eager_fallbacks"] == 0, stats


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loop_whose_sizes_change_every_step_is_captured_once_with_dynamic_sizes(backend: str) -> None:
    """Batch 3, 4, 5, ...: the first two sightings differ, the third is captured dynamic and the rest hit it."""
    result = compare(lambda i: _mlp_backward(3, 16, batch=3 + i), backend, steps=6, impl="ca-capture-after-2")
    result.assert_ok()
    stats = result.stats
    assert (stats["deferred_captures"], stats["captures"], stats["cache_hits"]) == (2, 1, 3), stats
    assert stats["eager_fallbacks"] == 0, stats


def test_a_size_that_changes_then_comes_back_is_captured_on_its_return() -> None:
    """Batches 3, 5, 5, 5: the second sighting changed sizes, the third is the same as the second and is captured."""
    ca_runtime.reset()
    with ca_runtime.enable("eager", capture_after=2):
        _mlp_backward(2, 16, batch=3)
        _mlp_backward(2, 16, batch=5)
        assert (ca_runtime.stats()["deferred_captures"], ca_runtime.stats()["captures"]) == (2, 0)
        _mlp_backward(2, 16, batch=5)
        assert (ca_runtime.stats()["deferred_captures"], ca_runtime.stats()["captures"]) == (2, 1)
        _mlp_backward(2, 16, batch=5)
        assert ca_runtime.stats()["cache_hits"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_captured_graph_whose_sizes_change_is_captured_again_at_once(backend: str) -> None:
    """Batches 3, 3, 5, 5, 3: the 5 is a recapture, never a deferral that would let the next 5 hit the 3's graph.

    See [Note: A graph's changed sizes are not deferred] in ca_core: a
    deferral there overwrote the sizes the graph was compiled for, and a
    tensor hook then saw the old batch's grad shape.
    """
    batches = (3, 3, 5, 5, 3)

    def step(i: int) -> Any:
        gen = torch.Generator().manual_seed(i)
        w = torch.randn(4, 2, generator=gen).requires_grad_()
        seen: list[torch.Size] = []
        h = torch.randn(batches[i], 4, generator=gen) @ w
        h.register_hook(lambda g: seen.append(g.shape))
        h.tanh().square().sum().backward()
        return w.grad, torch.tensor(seen)

    result = compare(step, backend, steps=len(batches), impl="ca-capture-after-2")
    result.assert_ok()
    stats = result.stats
    assert (stats["deferred_captures"], stats["captures"], stats["cache_hits"]) == (1, 2, 2), stats
    assert stats["eager_fallbacks"] == 0, stats


def test_sizes_do_not_delay_capture_after_1() -> None:
    """capture_after=1 captures the first backward (no sighting to compare with), then misses on sizes as before."""
    ca_runtime.reset()
    with ca_runtime.enable("eager", capture_after=1):
        for batch in (3, 4, 5):
            _mlp_backward(2, 16, batch=batch)
    stats = ca_runtime.stats()
    assert stats["deferred_captures"] == 0 and stats["captures"] == 2 and stats["cache_hits"] == 1, stats


#: (capture_after, sightings, sizes_changed) -> whether the backward is deferred.
#: ca_core never passes sizes_changed with 0 sightings (nothing to compare with).
RULE_TABLE = {
    (1, 0, False): False,
    (1, 1, False): False,
    (1, 1, True): False,
    (1, 3, True): False,
    (2, 0, False): True,
    (2, 1, False): False,
    (2, 1, True): True,
    (2, 2, True): False,
    (2, 3, False): False,
    (3, 0, False): True,
    (3, 1, False): True,
    (3, 2, False): False,
    (3, 2, True): True,
    (3, 3, True): False,
}


@pytest.mark.parametrize(("capture_after", "sightings", "sizes_changed"), list(RULE_TABLE))
def test_the_rule_as_a_table(capture_after: int, sightings: int, sizes_changed: bool) -> None:
    runtime = ca_runtime.Runtime("eager")
    runtime.capture_after = capture_after
    expected = RULE_TABLE[capture_after, sightings, sizes_changed]
    assert runtime.defer_capture(sightings, [], sizes_changed) is expected


@pytest.mark.parametrize("capture_after", [3, 5])
def test_capture_after_n_defers_n_minus_1_backwards_with_eagers_grads_and_hooks(capture_after: int) -> None:
    steps = capture_after + 2
    with ca_runtime.disable():
        eager = [_step(i) for i in range(steps)]
    ca_runtime.reset()
    with ca_runtime.enable("aot_eager", capture_after=capture_after):
        ours = []
        for i in range(steps):
            ours.append(_step(i))
            stats = ca_runtime.stats()
            # Each backward as it happens: deferred, then one capture, then hits.
            assert stats["deferred_captures"] == min(i + 1, capture_after - 1), (i, stats)
            assert stats["captures"] == (1 if i + 1 >= capture_after else 0), (i, stats)
    for (grad_e, calls_e, order_e), (grad_o, calls_o, order_o) in zip(eager, ours):
        torch.testing.assert_close(grad_o, grad_e)
        assert (int(calls_o), int(order_o)) == (int(calls_e), int(order_e))
    assert ca_runtime.stats()["cache_hits"] == 2
    assert ca_runtime.stats()["eager_fallbacks"] == 0


def test_reset_forgets_sightings() -> None:
    ca_runtime.reset()
    with ca_runtime.enable("eager", capture_after=2):
        _step(0)
        ca_runtime.reset()
        _step(1)
        assert (ca_runtime.stats()["deferred_captures"], ca_runtime.stats()["captures"]) == (1, 0)
        _step(2)
        assert ca_runtime.stats()["captures"] == 1


def _routine(a: torch.Tensor) -> torch.Tensor:
    return (a.sin() * a).exp().sum(0, keepdim=True) * a.cos()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_and_gradgradcheck_backwards_are_never_captured(backend: str) -> None:
    def check(i: int) -> Any:
        a = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(i)).requires_grad_()
        return torch.tensor(
            [torch.autograd.gradcheck(_routine, (a,)), torch.autograd.gradgradcheck(_routine, (a,))]
        )

    result = compare(check, backend, steps=2, expect_capture=False)
    result.assert_ok()
    stats = result.stats
    assert stats["captures"] == 0 and stats["eager_fallbacks"] == 0, stats
    assert stats["deferred_captures"] > 0, stats


def test_a_graph_captured_before_gradcheck_still_hits_inside_it() -> None:
    """A backward run inside gradcheck's frames (here from the checked function) whose graph was captured before."""
    w = torch.randn(3, requires_grad=True)

    def probe() -> None:
        (w * w).sin().sum().backward()

    def checked(a: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            probe()  # inside gradcheck: the cached graph serves it
        return a.sin()

    ca_runtime.reset()
    with ca_runtime.enable("aot_eager", capture_after=1):
        probe()  # w.grad is None: one key path
        probe()  # w.grad is set: the key path gradcheck's probes take
        assert (ca_runtime.stats()["captures"], ca_runtime.stats()["cache_hits"]) == (2, 0)
        assert torch.autograd.gradcheck(checked, (torch.randn(2, dtype=torch.float64, requires_grad=True),))
        stats = ca_runtime.stats()
    assert stats["captures"] == 2 and stats["cache_hits"] > 0 and stats["deferred_captures"] > 0, stats
    with ca_runtime.disable():
        w2 = w.detach().requires_grad_()
        for _ in range(2 + stats["cache_hits"]):
            (w2 * w2).sin().sum().backward()
        expected = w2.grad
    torch.testing.assert_close(w.grad, expected)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (0, ValueError, "capture_after must be at least 1, got 0"),
        (-2, ValueError, "capture_after must be at least 1"),
        ("2", TypeError, "capture_after must be an int, got str"),
        (True, TypeError, "capture_after must be an int, got bool"),
        (2.0, TypeError, "capture_after must be an int, got float"),
    ],
)
def test_bad_capture_after_names_the_argument_and_keeps_the_hook(
    value: Any, error: type, message: str
) -> None:
    with ca_runtime.enable("eager") as outer:
        with pytest.raises(error, match=message):
            ca_runtime.enable("eager", capture_after=value)
        import ca_core

        assert ca_core.installed_runtime() is outer


class _Swapper:
    def __init__(self, handle: torch.utils.hooks.RemovableHandle) -> None:
        self.handle = handle

    def __call__(self, grad: torch.Tensor) -> None:
        self.handle.remove()

    def method(self, grad: torch.Tensor) -> None:
        self.handle.remove()


class _RegistersInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad.register_hook(lambda g: g)
        return grad * 2


def _nested(grad: torch.Tensor) -> None:
    def inner() -> None:
        grad.register_hook(lambda g: g)

    inner()


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (lambda h: lambda g: g * 2, False),
        (lambda h: lambda g: h.remove(), True),
        (_Swapper, True),
        (lambda h: _Swapper(h).method, True),
        (lambda h: functools.partial(functools.partial(_Swapper.method, _Swapper(h))), True),
        (lambda h: _nested, True),
        (lambda h: print, False),
        (lambda h: object(), False),
    ],
    ids=[
        "plain",
        "lambda",
        "callable-instance",
        "bound-method",
        "partial",
        "nested-function",
        "builtin",
        "data",
    ],
)
def test_the_look_at_hook_code_sees_registrations_and_removals(make: Any, names: bool) -> None:
    """See [Note: Which captures wait]: the third rule's look at the code a graph would call."""
    from ca_runtime._runtime import _function_naming_a_hook_change

    handle = torch.ones(1, requires_grad=True).register_hook(lambda g: g)
    assert (_function_naming_a_hook_change([make(handle)]) is not None) is names


def test_the_look_at_hook_code_sees_a_functions_backward() -> None:
    from ca_runtime._runtime import _function_naming_a_hook_change

    x = torch.ones(2, requires_grad=True)
    y = _RegistersInBackward.apply(x)
    ctx = y.grad_fn
    assert _function_naming_a_hook_change([ctx]) == f"{__name__}._RegistersInBackward.backward"
    assert not _function_naming_a_hook_change([(x * 2).grad_fn])  # a C++ node: no Python code
