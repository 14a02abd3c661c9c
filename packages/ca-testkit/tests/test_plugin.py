"""The pytest plugin, exercised through pytester: a passing and a failing comparison."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

_PASSING = """
import torch

def test_mlp(ca_compare):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    calls = []

    def step():
        calls.clear()
        hidden = model[1](model[0](x))
        hidden.register_hook(lambda g: calls.append("hook") or g)
        model[2](hidden).sum().backward()
        return list(calls)

    results = ca_compare(step, tensors=model, steps=2, max_captures=2)
    assert all(r.ok for r in results)
"""

_FAILING = """
import pytest
import torch

def doubling_compiler(gm):
    # A deliberately wrong compiler: every grad the graph returns is doubled.
    def run(*args):
        return [None if g is None else g * 2 for g in gm(*args)]
    return run

@pytest.mark.ca_compare(backend=doubling_compiler, steps=1)
def test_wrong(ca_compare):
    w = torch.ones(3, requires_grad=True)
    ca_compare(lambda: (w * 3).sum().backward(), tensors={"w": w})
"""


def test_passing_comparison(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_PASSING)
    result = pytester.runpytest_subprocess("--ca-backend", "eager")
    result.assert_outcomes(passed=1)


def test_failing_comparison_prints_a_readable_diff(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_FAILING)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*compiled autograd differs from eager*",
            "*[[]ca[]] 1 of 2 values differ over 1 step(s); stats: captures=1*",
            "*MISMATCH step0.grad[[]w[]]*max_abs=3 max_rel=1 shape=3 dtype=float32*",
        ]
    )


def test_both_implementations_side_by_side(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_PASSING)
    result = pytester.runpytest_subprocess("--ca-impl", "both", "--ca-backend", "eager")
    result.assert_outcomes(passed=1)


def test_unknown_impl_is_a_clear_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_PASSING)
    result = pytester.runpytest_subprocess("--ca-impl", "nope")
    result.stdout.fnmatch_lines(["*ValueError: impl: unknown implementation 'nope'*"])


_SUITE = """
import ca_runtime
import pytest
import torch


@pytest.mark.parametrize("n", [1, 2])
def test_grads(n):
    w = torch.ones(3, requires_grad=True)
    (w * w * n).sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0 * n))


def test_backward_twice_raises():
    w = torch.ones(3, requires_grad=True)
    loss = (w * w).sum()
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_sees_ca():
    w = torch.ones(3, requires_grad=True)
    before = ca_runtime.stats()["captures"]
    (w * 2).sum().backward()
    assert ca_runtime.stats()["captures"] == before, "captured"
"""


def test_ca_wrap_runs_every_test_twice_and_reports_differences(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_SUITE)
    json_path = pytester.path / "wrap.json"
    result = pytester.runpytest_subprocess(
        "--ca-wrap=eager", f"--ca-wrap-json={json_path}", "-p", "no:cacheprovider"
    )
    # 4 tests x 2 modes; test_sees_ca fails only when wrapped.
    result.assert_outcomes(passed=7, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*ca-wrap (eager)*",
            "1 of 4 tests behave differently under ca_runtime.enable('eager', capture_after=1)",
            "*test_sees_ca: value mismatch; eager passed; ca failed (AssertionError: captured*; captures 1, eager fallbacks 0",
        ]
    )
    import json

    report = json.loads(json_path.read_text())
    assert report["backend"] == "eager"
    assert [d["test"].split("::")[-1] for d in report["differences"]] == ["test_sees_ca"]
    assert report["differences"][0]["captures"] == 1
    tests = {test.split("::")[-1]: run for test, run in report["tests"].items()}
    assert sorted(tests) == ["test_backward_twice_raises", "test_grads[1]", "test_grads[2]", "test_sees_ca"]
    assert tests["test_grads[1]"] == {"eager": "passed", "ca": "passed", "captures": 1, "eager_fallbacks": 0}
    assert tests["test_backward_twice_raises"]["captures"] == 1


def test_ca_wrap_calls_a_failed_bare_assert_a_value_mismatch(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import ca_runtime
        import torch

        def test_bare_assert():
            w = torch.ones(3, requires_grad=True)
            (w * 2).sum().backward()
            assert ca_runtime.stats()["captures"] == 0
        """
    )
    result = pytester.runpytest_subprocess("--ca-wrap=eager", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*test_bare_assert: value mismatch; eager passed; ca failed (assert 1 == 0*"]
    )


def test_ca_wrap_under_xdist(pytester: pytest.Pytester) -> None:
    pytest.importorskip("xdist")
    pytester.makepyfile(_SUITE)
    result = pytester.runpytest_subprocess("--ca-wrap", "-n", "2", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=7, failed=1)
    result.stdout.fnmatch_lines(
        ["1 of 4 tests behave differently under ca_runtime.enable('aot_eager', capture_after=1)"]
    )


_UNITTEST_SUITE = """
import unittest

import ca_runtime
import torch


class Grads(unittest.TestCase):
    def setUp(self):
        self.w = torch.ones(3, requires_grad=True)

    def test_grad(self):
        (self.w * 3).sum().backward()
        self.assertTrue(torch.equal(self.w.grad, torch.full((3,), 3.0)))

    def test_sees_ca(self):
        served = lambda: ca_runtime.stats()["captures"] + ca_runtime.stats()["cache_hits"]
        before = served()
        (self.w * 2).sum().backward()
        self.assertEqual(served(), before)
"""


def test_ca_wrap_runs_unittest_methods_twice(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(_UNITTEST_SUITE)
    result = pytester.runpytest_subprocess("--ca-wrap=eager", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "1 of 2 tests behave differently under ca_runtime.enable('eager', capture_after=1)",
            "*Grads::test_sees_ca: value mismatch; eager passed; ca failed (AssertionError*; captures *, eager fallbacks 0",
        ]
    )


def test_plugin_loads_without_torch(pytester: pytest.Pytester) -> None:
    """The pytest11 entry point imports neither torch nor ca_core: unrelated suites stay unaffected."""
    pytester.makepyfile(
        """
        import sys

        def test_nothing_heavy_was_imported():
            assert "ca_testkit.plugin" in sys.modules  # the plugin did load
            heavy = [m for m in ("torch", "ca_core", "ca_runtime", "ca_core._C") if m in sys.modules]
            assert heavy == []
        """
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_public_names_resolve_lazily() -> None:
    import ca_testkit

    assert {name: getattr(ca_testkit, name) is not None for name in ca_testkit.__all__} == dict.fromkeys(
        ca_testkit.__all__, True
    )
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ca_testkit.nope  # noqa: B018
