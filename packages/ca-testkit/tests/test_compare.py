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
