"""``pytest --ca-wrap[=BACKEND]``: run a whole suite eagerly and under compiled autograd.

Every pytest test function runs twice, as written (``[ca-wrap-eager]``) and
with its body inside ``ca_runtime.enable(BACKEND, capture_after=1)``
(``[ca-wrap-ca]``: a test's first backward is captured, see [Note: Differential
runs capture at once] in ca_testkit.implementations); the
wrapping fixture is the innermost one, so the test's own fixtures are set up
as usual. unittest.TestCase methods, which pytest does not parametrise, get
a twin item (``[ca-wrap-ca]``) that runs the method (setUp and tearDown
included) inside ``enable()``. At the end the tests whose two outcomes differ
are listed in the terminal summary, each with a reason category and the
captures and eager fallbacks of its wrapped run. ``--ca-wrap-json PATH``
writes the same differences and, under ``"tests"``, every test run both ways
with its two outcomes and the wrapped run's captures and eager fallbacks.
Works under pytest-xdist: outcomes travel with the test reports.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import pytest

__all__ = ["Difference", "WrapPlugin", "categorize", "wrapped_run"]

_MODES = ("eager", "ca")
#: The ``ca-wrap-*`` part of a test id, with the dash that joins it to another parameter.
_ID = re.compile(r"(?<=\[)ca-wrap-(?:eager|ca)-|-?ca-wrap-(?:eager|ca)\b")


@dataclass(frozen=True)
class Outcome:
    """One run of one test: pytest's outcome and, for a failure, its exception line."""

    outcome: str
    error: str = ""
    captures: int = 0
    eager_fallbacks: int = 0


@dataclass(frozen=True)
class Difference:
    """A test whose wrapped run did not behave as its eager run."""

    test: str
    category: str
    eager: str
    ca: str
    captures: int
    eager_fallbacks: int


def _describe(outcome: Outcome) -> str:
    return outcome.outcome + (f" ({outcome.error})" if outcome.error else "")


def categorize(eager: Outcome, ca: Outcome) -> str | None:
    """Why two outcomes differ, or None when they agree (same outcome, same error)."""
    if eager.outcome == ca.outcome and eager.error == ca.error:
        return None
    if "skipped" in (eager.outcome, ca.outcome):
        return None
    if eager.outcome == "failed" and ca.outcome == "passed":
        return "error not raised"
    if eager.outcome == "passed":
        if re.search(r"freed|saved tensor|weakref|lifetime|alive", ca.error, re.IGNORECASE):
            return "lifetime"
        # pytest reports a rewritten bare ``assert`` as "assert <explanation>".
        if ca.error.startswith(("AssertionError", "assert ")):
            return "value mismatch"
        return "error raised"
    return "different error"


#: Mode of a unittest item under --ca-wrap ("eager" or "ca").
_UNITTEST_MODE = pytest.StashKey[str]()


@dataclass
class _UnittestRequest:
    """What wrapped_run reads from a fixture request, for a unittest item."""

    node: pytest.Item
    param: str


def wrapped_run(request: pytest.FixtureRequest, backend: str) -> Iterator[None]:
    """The ``_ca_wrap`` fixture's body (the fixture itself lives in ``ca_testkit.plugin``)."""
    mode = request.param
    request.node.user_properties.append(("ca_wrap_mode", mode))
    if mode == "eager":
        yield
        return
    import ca_runtime

    from ca_testkit.implementations import get_implementation

    before = ca_runtime.stats()
    try:
        # compare()'s "ca": enable(backend, capture_after=1); see [Note: Differential runs capture at once].
        with get_implementation("ca").enable(backend):
            yield
    finally:
        after = ca_runtime.stats()
        request.node.user_properties.append(
            ("ca_wrap_stats", {k: max(after[k] - before[k], 0) for k in ("captures", "eager_fallbacks")})
        )


class WrapPlugin:
    """Registered by ``ca_testkit.plugin`` when ``--ca-wrap`` is given."""

    def __init__(self, config: pytest.Config) -> None:
        self.backend: str = config.getoption("--ca-wrap")
        self.json_path: str | None = config.getoption("--ca-wrap-json")
        self.is_worker = hasattr(config, "workerinput")
        #: test id without the mode -> mode -> outcome
        self.outcomes: dict[str, dict[str, Outcome]] = {}

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        metafunc.fixturenames.append("_ca_wrap")
        metafunc.parametrize("_ca_wrap", _MODES, indirect=True, ids=[f"ca-wrap-{m}" for m in _MODES])

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        from _pytest.unittest import TestCaseFunction

        wrapped: list[pytest.Item] = []
        for item in items:
            wrapped.append(item)
            callspec = getattr(item, "callspec", None)
            fixturenames: list[str] | None = getattr(item, "fixturenames", None)
            if callspec is not None and "_ca_wrap" in callspec.params and fixturenames is not None:
                # pytest prunes the closure back to what the test asks for after
                # parametrising: request the wrapping fixture again, last (innermost).
                if "_ca_wrap" not in fixturenames:
                    fixturenames.append("_ca_wrap")
            elif isinstance(item, TestCaseFunction):
                # unittest methods are not parametrised: a second item runs
                # the same method wrapped (see pytest_runtest_call).
                twin = TestCaseFunction.from_parent(item.parent, name=item.name)
                twin._nodeid = item.nodeid + "[ca-wrap-ca]"  # type: ignore[attr-defined]
                item.stash[_UNITTEST_MODE] = "eager"
                twin.stash[_UNITTEST_MODE] = "ca"
                wrapped.append(twin)
        items[:] = wrapped

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[None]:
        mode = item.stash.get(_UNITTEST_MODE, None)
        if mode is None:
            yield
            return
        request = _UnittestRequest(item, mode)
        runs = wrapped_run(request, self.backend)  # type: ignore[arg-type]
        next(runs)
        yield
        next(runs, None)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props: dict[str, Any] = dict(report.user_properties)
        mode = props.get("ca_wrap_mode")
        if mode is None:
            return
        test = _ID.sub("", report.nodeid).replace("[]", "")
        previous = self.outcomes.setdefault(test, {}).get(mode)
        stats = props.get("ca_wrap_stats")
        if stats is not None and previous is not None:
            # The wrapped run's counters are known at teardown.
            previous = dataclasses.replace(previous, **stats)
            self.outcomes[test][mode] = previous
        if report.when != "call" and report.outcome == "passed":
            return
        if previous is not None and previous.outcome == "failed":
            return  # the first failing phase is the outcome
        error = ""
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            error = (crash.message if crash is not None else str(report.longrepr)).splitlines()[0]
        self.outcomes[test][mode] = Outcome(report.outcome, error, **(stats or {}))

    def differences(self) -> list[Difference]:
        out = []
        for test, by_mode in sorted(self.outcomes.items()):
            if set(by_mode) != set(_MODES):
                continue
            eager, ca = by_mode["eager"], by_mode["ca"]
            category = categorize(eager, ca)
            if category is not None:
                out.append(
                    Difference(
                        test, category, _describe(eager), _describe(ca), ca.captures, ca.eager_fallbacks
                    )
                )
        return out

    def wrapped_tests(self) -> dict[str, dict[str, Any]]:
        """Per test run in both modes: both outcomes and the wrapped run's counters."""
        return {
            test: {
                "eager": _describe(by_mode["eager"]),
                "ca": _describe(by_mode["ca"]),
                "captures": by_mode["ca"].captures,
                "eager_fallbacks": by_mode["ca"].eager_fallbacks,
            }
            for test, by_mode in sorted(self.outcomes.items())
            if set(by_mode) == set(_MODES)
        }

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        differences = self.differences()
        pairs = sum(1 for by_mode in self.outcomes.values() if set(by_mode) == set(_MODES))
        terminalreporter.section(f"ca-wrap ({self.backend})")
        terminalreporter.write_line(
            f"{len(differences)} of {pairs} tests behave differently under ca_runtime.enable({self.backend!r}, capture_after=1)"
        )
        for d in differences:
            terminalreporter.write_line(
                f"{d.test}: {d.category}; eager {d.eager}; ca {d.ca}; "
                f"captures {d.captures}, eager fallbacks {d.eager_fallbacks}"
            )

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.json_path and not self.is_worker:
            with open(self.json_path, "w") as f:
                json.dump(
                    {
                        "backend": self.backend,
                        "differences": [asdict(d) for d in self.differences()],
                        "tests": self.wrapped_tests(),
                    },
                    f,
                    indent=1,
                )
