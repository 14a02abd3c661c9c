"""compare() itself: it must pass what is equal and catch what is not."""

from __future__ import annotations

import ca_runtime
import ca_testkit
import pytest
import torch
from ca_testkit.scenarios import make_mlp, mlp_step


@pytest.fixture(autouse=True)
def clean_state():
    ca_runtime.reset()
    yield
    ca_runtime.reset()


def corrupting(gm: torch.fx.GraphModule):
    """A compiler whose graph returns every grad doubled: a planted wrong gradient."""

    def run(*args):
        return [None if g is None else g * 2 for g in gm(*args)]

    return run


def test_equal_run_is_ok() -> None:
    model = make_mlp()
    result = ca_testkit.compare(mlp_step(model), "eager", tensors=model, steps=2)
    assert result.ok, result.report()
    assert {d.name for d in result.diffs} >= {"step0.return[0]", "step1.grad[0.weight]"}


def test_planted_wrong_gradient_is_reported_per_tensor() -> None:
    model = make_mlp()
    result = ca_testkit.compare(mlp_step(model), corrupting, tensors=model)
    assert not result.ok
    names = {d.name for d in result.mismatches}
    assert names == {f"step0.grad[{n}]" for n, _ in model.named_parameters()}
    report = result.report()
    assert "MISMATCH step0.grad[0.weight]" in report and "max_abs=" in report
    with pytest.raises(AssertionError, match="differs from eager"):
        result.assert_ok()


def test_grads_restored_between_runs() -> None:
    model = make_mlp()
    for p in model.parameters():
        p.grad = torch.ones_like(p)

    def step(i: int) -> torch.Tensor:
        x = torch.ones(3, 8)
        loss = model(x).sum()
        loss.backward()  # accumulates onto the ones
        return loss

    ca_testkit.compare(step, "eager", tensors=model).assert_ok()


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="step"):
        ca_testkit.compare(42, "eager")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps"):
        ca_testkit.compare(lambda: None, "eager", steps=0)


def test_several_modules_are_compared_parameter_by_parameter() -> None:
    body, head = make_mlp(), torch.nn.Linear(4, 2)

    def step() -> None:
        head(body(torch.ones(3, 8))).sum().backward()

    result = ca_testkit.compare(step, "eager", tensors=[body, head])
    assert result.ok, result.report()
    assert {d.name for d in result.diffs} >= {"step0.grad[0.0.weight]", "step0.grad[1.bias]"}
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a tensor or a module"):
        ca_testkit.compare(step, "eager", tensors=[body, "head"])  # type: ignore[list-item]


def test_a_run_that_captured_nothing_fails() -> None:
    """Eager's answer from a backward that never compiled is no pass."""
    x = torch.ones(3, requires_grad=True)

    def no_backward() -> torch.Tensor:
        return (x * 2).detach()

    result = ca_testkit.compare(no_backward, "eager")
    assert not result.ok and result.summary() == "[ca] nothing was captured"
    assert ca_testkit.compare(no_backward, "eager", expect_capture=False).ok


def test_summary_names_the_kind_of_failure() -> None:
    model = make_mlp()
    result = ca_testkit.compare(mlp_step(model), corrupting, tensors=model)
    assert result.summary().startswith("[ca] 4 value(s) differ (step0.grad[0.weight]")


def upcasting(gm: torch.fx.GraphModule):
    """A compiler whose graph computes in float64 and hands back float32 grads: other rounding, no wrong value."""

    def run(*args):
        def up(a):
            return a.double() if isinstance(a, torch.Tensor) and a.dtype == torch.float32 else a

        return gm(*[[up(x) for x in a] if isinstance(a, list) else up(a) for a in args])

    return run


def second_derivative(i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A second derivative where float32 rounding shows: the same values in ``dtype``."""
    x = torch.linspace(0.1, 3.0, 64).to(dtype).requires_grad_()
    (g,) = torch.autograd.grad((x.pow(2.5).tanh() * x.exp()).sin().sum(), x, create_graph=True)
    (g2,) = torch.autograd.grad(g.square().sum(), x)
    return g2


def in_float64(i: int) -> torch.Tensor:
    return second_derivative(i, torch.float64)


@pytest.mark.parametrize(
    ("compiler", "ok_without", "ok_with"),
    [("eager", True, True), (upcasting, False, True), (corrupting, False, False)],
    ids=["eager", "other-rounding", "wrong-grad"],
)
def test_a_float64_reference_tells_rounding_from_a_wrong_gradient(compiler, ok_without, ok_with) -> None:
    """See [Note: A float64 reference for rounding backends]: rtol=atol=0 makes any rounding a difference."""
    without = ca_testkit.compare(second_derivative, compiler, rtol=0, atol=0)
    with_reference = ca_testkit.compare(second_derivative, compiler, rtol=0, atol=0, reference=in_float64)
    assert (without.ok, with_reference.ok) == (ok_without, ok_with), with_reference.report()
    for result in (without, with_reference):
        assert result.stats["captures"] == 2 and result.stats["eager_fallbacks"] == 0
    (diff,) = with_reference.diffs
    assert ("float64 reference:" in diff.note) == (not ok_without)  # judged by it only where it differs


def test_a_float64_reference_runs_only_when_a_value_differs() -> None:
    calls: list[int] = []

    def reference(i: int) -> torch.Tensor:
        calls.append(i)
        return in_float64(i)

    assert ca_testkit.compare(second_derivative, "eager", steps=2, reference=reference).ok
    assert calls == []
    assert ca_testkit.compare(second_derivative, upcasting, steps=2, rtol=0, atol=0, reference=reference).ok
    assert calls == [0, 1]
    with pytest.raises(TypeError, match="reference"):
        ca_testkit.compare(second_derivative, "eager", reference=42)  # type: ignore[arg-type]
