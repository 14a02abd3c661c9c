"""Shared set-up of the parity suite: under ``--ca-wrap`` every test starts from an empty ca cache.

The tests themselves are plain eager tests and import nothing of ca. When the
suite runs wrapped (``pytest parity --ca-wrap=BACKEND``), ``ca_runtime`` is
reset before each test so that the captures ``--ca-wrap`` counts per test are
that test's own, not hits on a graph an earlier test captured.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def fresh_ca_cache(request: pytest.FixtureRequest) -> Iterator[None]:
    """Empties ca_runtime's cache and counters before each test of a wrapped run; nothing otherwise."""
    if request.config.getoption("--ca-wrap", None):
        import ca_runtime

        ca_runtime.reset()
    yield
