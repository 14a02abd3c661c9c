"""pytest plugin (entry point ``pytest11``): the ``ca_compare`` fixture and marker.

Thin by design: nothing heavy (torch, ca_runtime) is imported until a test
asks for the fixture, so installing ca-testkit does not slow down unrelated
test runs. The work is in ``ca_testkit.runner``.

    def test_my_step(ca_compare):
        model = make_model()
        ca_compare(lambda: model(x).sum().backward(), tensors=model, steps=2)

    @pytest.mark.ca_compare(backend="eager", impl="both", steps=3)
    def test_both(ca_compare): ...

Command line: ``--ca-backend NAME`` and ``--ca-impl ca|torch|both``;
``--ca-wrap[=BACKEND]`` (and ``--ca-wrap-json PATH``) runs a whole suite
eagerly and under compiled autograd, see ``ca_testkit.wrap``.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ca_testkit", "compiled autograd differential testing")
    group.addoption(
        "--ca-backend",
        default="aot_eager",
        help="torch.compile backend the ca_compare fixture compiles with (default aot_eager)",
    )
    group.addoption(
        "--ca-impl",
        default="ca",
        help="compiled autograd to check: ca, torch, both or a comma list (default ca)",
    )
    group.addoption(
        "--ca-wrap",
        nargs="?",
        const="aot_eager",
        default=None,
        metavar="BACKEND",
        help="run every test twice, as written and inside ca_runtime.enable(BACKEND, capture_after=1) "
        "(default aot_eager), and report the tests whose outcome differs",
    )
    group.addoption(
        "--ca-wrap-json", default=None, metavar="PATH", help="write --ca-wrap's differences as JSON"
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--ca-wrap", None):
        from ca_testkit.wrap import WrapPlugin

        config.pluginmanager.register(WrapPlugin(config), "ca_testkit_wrap")
    config.addinivalue_line(
        "markers",
        "ca_compare(backend=None, impl=None, steps=None, rtol=None, atol=None): "
        "settings of the ca_compare fixture for this test",
    )


@pytest.fixture
def ca_compare(request: pytest.FixtureRequest) -> Any:
    """A callable ``ca_compare(step, tensors=..., steps=..., max_captures=...)``.

    Runs ``step`` eagerly and under compiled autograd and fails the test with a
    per-value diff (name, max abs/rel error, shape, dtype, hook-log
    differences) and the capture counts.
    """
    from ca_testkit.runner import CompareRunner, parse_impls

    marker = request.node.get_closest_marker("ca_compare")
    settings = dict(marker.kwargs) if marker else {}
    backend = settings.pop("backend", None) or request.config.getoption("--ca-backend")
    impls = parse_impls(settings.pop("impl", None) or request.config.getoption("--ca-impl"))
    kwargs = {k: v for k, v in settings.items() if v is not None}
    return CompareRunner(backend=backend, impls=impls, **kwargs)


@pytest.fixture
def _ca_wrap(request: pytest.FixtureRequest) -> Any:
    """Innermost fixture of every test under ``--ca-wrap``: the test body runs eagerly or inside ``enable()``."""
    from ca_testkit.wrap import wrapped_run

    yield from wrapped_run(request, request.config.getoption("--ca-wrap"))
