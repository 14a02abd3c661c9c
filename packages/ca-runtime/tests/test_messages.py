"""What a user reads: fallback messages name the compiler and what it returned, at the user's line.

See [Note: What a compiled graph returns] (_runtime.py) and warn_at_user_line (_log.py).
"""

from __future__ import annotations

import warnings
from typing import Any

import ca_runtime
import pytest
import torch
from ca_testkit import compare


def _returning(value: Any):
    def bad_compiler(gm: torch.fx.GraphModule):
        return lambda *args: value

    return bad_compiler


@pytest.mark.parametrize(
    ("returned", "said"),
    [
        (None, "gave None, not a list or tuple of 2 values"),
        ([], "gave a list of 0 values, not a list or tuple of 2 values"),
        (7, "gave an int, not a list or tuple of 2 values"),
    ],
    ids=["None", "empty list", "int"],
)
def test_a_compiled_callable_that_returns_the_wrong_thing_falls_back_saying_what(
    returned: Any, said: str
) -> None:
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with pytest.warns(ca_runtime.EagerFallbackWarning) as caught:
        result = compare(
            lambda: lin(x).sum().backward(), _returning(returned), tensors=lin, expect_capture=False
        )
    result.assert_ok()
    assert result.stats["captures"] == 1 and result.stats["eager_fallbacks"] == 1, result.stats
    (warning,) = [w for w in caught if issubclass(w.category, ca_runtime.EagerFallbackWarning)]
    text = str(warning.message)
    assert "compiler_fn _returning.<locals>.bad_compiler (" in text and said in text, text
    assert "return gm, torch.compile(gm, ...)" in text
    assert warning.filename == __file__, warning.filename  # the user's backward() line
    (entry,) = ca_runtime.cache_info()
    assert entry.failed and said in entry.failure, entry


def test_a_compiler_fn_that_returns_none_names_itself() -> None:
    lin = torch.nn.Linear(3, 2)
    said = r"compiler_fn test_a_compiler_fn_that_returns_none_names_itself.<locals>.<lambda> \(.*\) returned None"
    with (
        pytest.warns(ca_runtime.EagerFallbackWarning, match=said),
        ca_runtime.enable(lambda gm: None, capture_after=1),
    ):
        lin(torch.randn(4, 3)).sum().backward()
    assert ca_runtime.stats()["eager_fallbacks"] == 1


def test_graph_break_warning_names_the_users_line(cpp_ext: Any) -> None:
    x = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught, ca_runtime.enable("eager", capture_after=1):
        warnings.simplefilter("always")
        cpp_ext.writes_through_data_ptr(x * 1.5).sum().backward()
    breaks = [w for w in caught if issubclass(w.category, ca_runtime.GraphBreakWarning)]
    assert breaks and all(w.filename == __file__ for w in breaks), [(w.filename, w.lineno) for w in breaks]
