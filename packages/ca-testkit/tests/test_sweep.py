"""The OpInfo sweep classifies ops; a wrong grad is a mismatch, never a pass or an error."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("expecttest", reason="the OpInfo database needs expecttest (ca-testkit[sweep])")

from ca_testkit import sweep  # noqa: E402
from ca_testkit.__main__ import main  # noqa: E402


def _doubling_compiler(gm):
    def run(*args):
        return [None if g is None else g * 2 for g in gm(*args)]

    return run


@pytest.mark.parametrize("impl", ["ca", "torch"])
def test_passing_ops(impl: str) -> None:
    for name in ("mul", "sin"):
        assert sweep.sweep_op(name, "eager", impl).result == "pass"


def test_wrong_grads_are_mismatches() -> None:
    result = sweep.sweep_op("mul", _doubling_compiler, "ca")
    assert result.result == "mismatch"


def test_cli_writes_json_and_summary(tmp_path, capsys) -> None:
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--ops", "sinh", "--backend", "eager", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ops"]["sinh"]["result"] == "pass" and data["counts"] == {"pass": 1}
    assert "pass" in capsys.readouterr().out
    md = tmp_path / "cmp.md"
    assert main(["report", str(out), str(out), "--markdown", str(md)]) == 0
    assert "| pass | 1 | 1 |" in md.read_text()
