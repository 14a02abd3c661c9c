"""The repository's parity suite (``parity/``) under ``--ca-wrap=eager``: it differs from eager only where known.

The suite runs in a fresh process, as ``pytest parity --ca-wrap=eager`` from
the repository root (its pyproject's settings: a silent eager fallback is an
error). Its differences must be exactly the expected ones, so a new
difference fails here and so does a fixed one (remove its entry). The
per-test outcomes and capture counts come from ``--ca-wrap-json``'s
``"tests"``. ``nox -s parity`` runs the suite with eager and aot_eager.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PARITY = REPO / "parity"
README = REPO / "README.md"

# Items of README's "Known differences from eager", quoted (whitespace aside).
CURRENT_NODE_IS_NONE = (
    "`torch._C._current_autograd_node()` called from a hook or a custom Function's backward returns `None`"
)
ANOMALY_RUNS_EAGERLY = "Anomaly mode runs backwards eagerly"
HOOKS_CHANGED_RUNS_EAGERLY = (
    "A graph whose hooks register or remove hooks of nodes later in the same backward runs on the eager engine, "
    "with an `EagerFallbackWarning`"
)
ONE_PROFILER_RANGE = (
    "Under `torch.profiler`, a compiled backward shows as the compiled graph's ranges and kernels, "
    "not one `autograd::engine::evaluate_function` range per node"
)

#: Differences by design: test id -> the README known difference it shows.
BY_DESIGN: dict[str, str] = {
    "parity/test_introspection.py::test_current_autograd_node_in_a_tensor_hook_is_the_node_it_runs_before": (
        CURRENT_NODE_IS_NONE
    ),
    # A Function's backward is called from the compiled graph too, outside the engine's node loop.
    "parity/test_introspection.py::test_current_autograd_node_in_a_custom_functions_backward": CURRENT_NODE_IS_NONE,
    "parity/test_introspection.py::test_the_profiler_shows_one_range_per_node_with_its_sequence_number": (
        ONE_PROFILER_RANGE
    ),
    # See [Note: Hooks changed while a graph runs] (ca_core): the warning is an error under --ca-wrap.
    "parity/test_hook_order.py::test_a_hook_that_removes_a_later_hook_and_registers_another": (
        HOOKS_CHANGED_RUNS_EAGERLY
    ),
    # Its hook names a removal, so the graph is declined at its second backward, with the warning.
    "parity/test_hook_order.py::test_a_hook_that_swaps_a_later_hook_only_on_its_third_backward": (
        HOOKS_CHANGED_RUNS_EAGERLY
    ),
}

#: Differences that are ca bugs, reported and not fixed yet: test id -> the bug. Remove an entry once fixed.
KNOWN_BUGS: dict[str, str] = {}

_NO_BACKWARD = "no backward runs"
_USERS_ERROR = "the walk meets the user's error; eager raises it, nothing is captured"

#: Wrapped tests that capture nothing: test id -> why.
NOT_CAPTURED: dict[str, str] = {
    **{
        f"parity/test_anomaly.py::{name}": ANOMALY_RUNS_EAGERLY
        for name in (
            "test_detect_anomaly_names_the_node_that_returned_nan",
            "test_set_detect_anomaly_names_the_node_that_returned_nan",
            "test_detect_anomaly_warns_with_the_forward_traceback_of_the_failing_node",
            "test_detect_anomaly_names_a_custom_functions_backward",
            "test_detect_anomaly_without_check_nan_lets_nan_through",
            "test_anomaly_mode_is_visible_inside_a_hook_and_grads_are_exact",
        )
    },
    # See [Note: Hooks changed while a graph runs] (ca_core): a hook naming a registration runs eagerly first.
    "parity/test_hook_order.py::test_a_hook_that_removes_a_later_hook_and_registers_another": (
        "its one backward runs eagerly before a capture, and the hook's change sends that graph to eager"
    ),
    "parity/test_hook_order.py::test_a_hook_that_swaps_a_later_hook_only_on_its_third_backward": (
        "its first backward runs eagerly before a capture, and the next declines the graph: its hook names a removal"
    ),
    "parity/test_function_errors.py::test_save_for_backward_of_a_non_tensor_raises_in_forward": _NO_BACKWARD,
    "parity/test_introspection.py::test_grad_fns_are_autograd_graph_nodes": _NO_BACKWARD,
    "parity/test_introspection.py::test_next_functions_describe_the_graph": _NO_BACKWARD,
    "parity/test_views_inplace.py::test_in_place_on_a_leafs_view_raises": _NO_BACKWARD,
    "parity/test_views_inplace.py::test_modifying_a_saved_input_in_place_raises_in_backward": _USERS_ERROR,
    "parity/test_views_inplace.py::test_modifying_a_saved_output_in_place_raises_in_backward": _USERS_ERROR,
    "parity/test_views_inplace.py::test_modifying_a_saved_tensor_through_a_view_raises_in_backward": _USERS_ERROR,
}

needs_checkout = pytest.mark.skipif(
    not PARITY.is_dir(),
    reason=f"{PARITY} is not here: ca-testkit is installed without the repository checkout",
)


def _known_differences_section() -> str:
    text = README.read_text()
    section = text.split("## Known differences from eager", 1)[1].split("\n## ", 1)[0]
    return " ".join(section.split())


@needs_checkout
def test_by_design_reasons_quote_the_readmes_known_differences() -> None:
    section = _known_differences_section()
    reasons = {*BY_DESIGN.values(), ANOMALY_RUNS_EAGERLY}
    assert {reason for reason in reasons if reason not in section} == set()


@needs_checkout
def test_parity_suite_differs_from_eager_only_where_known(tmp_path: Path) -> None:
    pytest.importorskip("ca_runtime")
    json_path = tmp_path / "wrap.json"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "parity",
        "--ca-wrap=eager",
        "-p",
        "no:cacheprovider",
        f"--ca-wrap-json={json_path}",
        "-q",
    ]
    run = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True, timeout=600)
    output = (run.stdout + run.stderr)[-4000:]
    # Exit status 1: the known differences fail their wrapped runs.
    assert run.returncode in (0, 1) and json_path.is_file(), output

    report = json.loads(json_path.read_text())
    stats = report["tests"]
    eager_not_passed = sorted(test for test, runs in stats.items() if runs["eager"] != "passed")
    assert eager_not_passed == [], f"every parity test must pass eagerly\n{output}"
    assert len(stats) >= 60, f"only {len(stats)} wrapped tests ran\n{output}"

    differences = {d["test"]: d for d in report["differences"]}
    expected = {**BY_DESIGN, **KNOWN_BUGS}
    new = {test: f"{d['category']}: ca {d['ca']}" for test, d in differences.items() if test not in expected}
    gone = sorted(test for test in expected if test not in differences)
    assert new == {}, "differences from eager that are neither by design nor known bugs"
    assert gone == [], "these now behave as eager: remove them from BY_DESIGN / KNOWN_BUGS"

    not_captured = {test for test, counts in stats.items() if counts["captures"] == 0}
    assert not_captured == set(NOT_CAPTURED), "wrapped tests that captured nothing"
    fell_back = {test for test, counts in stats.items() if counts["eager_fallbacks"] > 0}
    assert fell_back == {test for test, why in NOT_CAPTURED.items() if why == ANOMALY_RUNS_EAGERLY}
