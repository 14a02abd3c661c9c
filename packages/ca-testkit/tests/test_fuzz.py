"""The random-graph fuzzer finds a planted bug and shrinks it; a short clean run."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="the fuzzer needs hypothesis (ca-testkit[fuzz])")

from ca_testkit import fuzz  # noqa: E402


def test_planted_bug_is_found_and_shrunk() -> None:
    failing = fuzz.fuzz(300, compiler_fn=fuzz.planted_bug_compiler(), seed=0)
    assert failing is not None, "the fuzzer missed a grad that is 1% off"
    # Minimal: one op that uses one tensor twice, so that two grads are summed.
    assert len(failing.steps) == 1
    (step,) = failing.steps
    assert len(set(step.args)) < len(step.args) or step.op == "square"
    namespace: dict[str, object] = {}
    exec(compile(failing.snippet(), "<snippet>", "exec"), namespace)  # the snippet runs


@pytest.mark.parametrize(("backend", "examples"), [("none", 300), ("eager", 15)])
def test_short_clean_budget(backend: str, examples: int) -> None:
    failing = fuzz.fuzz(examples, backend, seed=11)
    assert failing is None, repr(failing)


def test_every_op_row_runs_and_reaches_the_leaf() -> None:
    steps = tuple(fuzz.Step(op, (k,) * fuzz.OPS[op].arity) for k, op in enumerate(sorted(fuzz.OPS)))
    program = fuzz.Program((True,), steps, (len(steps),), seed=3)
    grads, _ = fuzz.run_program(program)
    assert grads[1] is not None and {s.op for s in program.steps} == set(fuzz.OPS)
    assert fuzz.check_program(program, lambda gm: gm).ok
