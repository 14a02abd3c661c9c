"""The OpInfo sweep classifies ops; a wrong grad is a mismatch, never a pass or an error."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("expecttest", reason="the OpInfo database needs expecttest (ca-testkit[sweep])")

from ca_testkit import sweep
from ca_testkit.__main__ import main


def _doubling_compiler(gm):
    def run(*args):
        return [None if g is None else g * 2 for g in gm(*args)]

    return run


def _sleeping_compiler(gm):
    time.sleep(30)
    return gm


@pytest.mark.parametrize("impl", ["ca", "torch"])
def test_passing_ops(impl: str) -> None:
    for name in ("mul", "sin"):
        assert sweep.sweep_op(name, "eager", impl).result == "pass"


def test_wrong_grads_are_mismatches() -> None:
    result = sweep.sweep_op("mul", _doubling_compiler, "ca")
    assert result.result == "mismatch"
    assert result.detail.startswith("sample 0: grad 0") and "max abs err" in result.detail


@pytest.mark.parametrize("name", ["mul", "abs"])
def test_complex64_ops_are_compared(name: str) -> None:
    result = sweep.sweep_op(name, "eager", "ca", 3, dtype="complex64")
    assert (result.result, result.dtype, result.key) == ("pass", "complex64", f"{name}[complex64]")
    assert result.samples >= 1 and result.captures >= 1
    assert sweep.sweep_op(name, _doubling_compiler, "ca", 1, dtype="complex64").result == "mismatch"


def test_complex_outputs_of_real_inputs_are_compared() -> None:
    # Skipped before the loss took real and imaginary parts.
    result = sweep.sweep_op("view_as_complex", "eager", "ca", dtype="float32")
    assert result.result == "pass" and result.samples >= 1 and result.captures >= 1


def test_samples_of_one_op_share_the_cache() -> None:
    result = sweep.sweep_op("cumsum", "eager", "ca", None)
    assert result.result == "pass" and result.samples >= 3
    assert result.cache_hits > 0 and result.captures + result.cache_hits == result.samples


def test_select_every_and_dtypes() -> None:
    names = sweep.select_ops("s*")
    assert names == sorted(names) and "sin" in names
    assert sweep.select("s*", ("float32",), 3) == [(n, "float32") for n in names[::3]]
    pairs = sweep.select("sin", ("float32", "complex64"))
    assert pairs == [("sin", "float32"), ("sin", "complex64")]
    assert sweep.parse_dtypes("float32, complex64,float32") == ("float32", "complex64")
    with pytest.raises(ValueError):
        sweep.parse_dtypes("float33")


def test_a_slow_op_is_a_timeout_and_the_timer_is_cancelled() -> None:
    previous = signal.getsignal(signal.SIGALRM)
    start = time.perf_counter()
    # The timer's exception is swallowed into an eager fallback by the runtime; the flag still tells.
    result = sweep.sweep_op("sin", _sleeping_compiler, "ca", dtype="float32", timeout=0.5)
    assert time.perf_counter() - start < 10
    assert result.result == "timeout" and "sample 0" in result.detail
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is previous
    assert sweep.sweep_op("sin", "eager", "ca", timeout=30).result == "pass"
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_summary_names_every_op_that_did_not_pass() -> None:
    results = [
        sweep.OpResult("a", "mismatch", "sample 1: grad 0 differs", 2, 2),
        sweep.OpResult("b", "error", "sample 0: RuntimeError: boom", 1, 0, dtype="complex64"),
        sweep.OpResult("c", "timeout", "no result within 1 s", 0, 0),
        sweep.OpResult("d", "eager-fallback", "sample 0: nothing was captured", 1, 0),
        sweep.OpResult("e", "graph-break-pass", "sample 0: 1 graph break(s)", 1, 1),
        sweep.OpResult("f", "pass", "", 3, 2, cache_hits=1),
        sweep.OpResult("f", "pass", "", 2, 2, dtype="complex64"),
        sweep.OpResult("g", "skipped", "no sample with a differentiable output", 0, 0),
    ]
    text = sweep.summary(results)
    for r in results[:5]:
        assert f"{r.key}: {r.detail}" in text
    assert "f[" not in text and "g[" not in text
    assert "7 ops, 8 (op, dtype) results (complex64, float32), 10 samples compared" in text
    assert text.index("mismatch (1):") < text.index("timeout (1):") < text.index("eager-fallback (1):")


def test_cli_writes_json_and_summary(tmp_path, capsys) -> None:
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--ops", "sinh", "--backend", "eager", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["ops"]["sinh[float32]"]["result"] == "pass" and data["counts"] == {"pass": 1}
    assert data["version"] == 2 and data["dtypes"] == ["float32"] and data["totals"]["samples"] >= 1
    text = capsys.readouterr().out
    assert "pass" in text and "1 ops, 1 (op, dtype) results" in text
    md = tmp_path / "cmp.md"
    assert main(["report", str(out), str(out), "--markdown", str(md)]) == 0
    assert "| pass | 1 | 1 |" in md.read_text()


def test_cli_all_samples_dtypes_and_old_reports(tmp_path, capsys) -> None:
    out = tmp_path / "sweep.json"
    args = [
        "sweep",
        "--ops",
        "cumsum",
        "--backend",
        "eager",
        "--samples",
        "all",
        "--dtype",
        "float32,complex64",
    ]
    assert main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["ops"]) == {"cumsum[float32]", "cumsum[complex64]"} and data["samples"] == "all"
    assert data["ops"]["cumsum[complex64]"]["samples"] >= 3 and data["totals"]["cache_hits"] > 0
    # A version-1 report (float32 only, keyed by op name) compares with a new one.
    old = tmp_path / "old.json"
    old.write_text(
        json.dumps(
            {
                "impl": "ca",
                "backend": "aot_eager",
                "counts": {"error": 1},
                "ops": {"cumsum": {"result": "error", "detail": "x", "samples": 2, "captures": 0}},
            }
        )
    )
    capsys.readouterr()
    assert main(["report", str(old), str(out)]) == 0
    text = capsys.readouterr().out
    assert "| cumsum[float32] | error | pass |" in text and "| cumsum[complex64] | - | pass |" in text
    assert main(["sweep", "--ops", "cumsum", "--dtype", "float33"]) == 2


def test_cli_timeout_is_listed(capsys) -> None:
    assert main(["sweep", "--ops", "sinh", "--backend", "eager", "--timeout", "0.000001"]) == 0
    text = capsys.readouterr().out
    assert "timeout (1):\n  sinh[float32]: no result within" in text


def test_workers_time_out_and_are_replaced(tmp_path, monkeypatch) -> None:
    for var in ("CA_SWEEP_TEST_SLEEP", "CA_SWEEP_TEST_BLOCK"):
        marker = tmp_path / var
        marker.touch()
        monkeypatch.setenv(var, str(marker))
    monkeypatch.setattr(sweep, "KILL_GRACE", 1.0)
    tasks = [("neg", "float32"), ("sin", "float32"), ("abs", "complex64")]
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "workers"))
    from sweep_compilers import stalling_once_compiler

    # The stalled samples sleep 60 s; 5 s leaves the one that passes room on a loaded machine (1 s did not).
    results = sweep.run_sweep(tasks, stalling_once_compiler, "ca", jobs=2, max_samples=1, timeout=5.0)
    assert sorted((r.op, r.dtype) for r in results) == sorted(tasks)
    assert sorted(r.result for r in results) == ["pass", "timeout", "timeout"]
    details = sorted(r.detail for r in results if r.result == "timeout")
    assert sum("worker killed" in d for d in details) == 1, details


def test_ops_takes_a_comma_separated_list_of_patterns() -> None:
    from ca_testkit import sweep

    assert sweep.select_ops("sin, cos") == ["cos", "sin"]
    assert set(sweep.select_ops("sin,tanh*")) >= {"sin", "tanh"}


def test_cli_without_the_sweep_extra_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from ca_testkit.__main__ import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "expecttest" else real(name, *a)
    )
    assert main(["sweep", "--ops", "sin"]) == 2
    assert "pip install 'ca-testkit[sweep]'" in capsys.readouterr().err
