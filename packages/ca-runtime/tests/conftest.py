"""Shared fixtures: every differential test runs per backend, eager is the oracle."""

from __future__ import annotations

from types import ModuleType

import ca_core
import ca_runtime
import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # Also registered at the repository root; repeated here so that running
    # this package's tests alone (its own rootdir) knows the marker.
    config.addinivalue_line("markers", "inductor: compiles with inductor (10-100 s each on 2 cores)")
    config.addinivalue_line(
        "markers", "distributed: starts 2-rank gloo jobs in fresh processes (about 10 s each)"
    )


@pytest.fixture(params=["eager", "aot_eager"])
def backend(request: pytest.FixtureRequest) -> str:
    """The torch.compile backends unit tests run under (inductor is marked separately)."""
    return request.param


@pytest.fixture(autouse=True)
def clean_state():
    """Each test starts with an empty cache, zero counters and no hook installed."""
    ca_runtime.reset()
    torch._dynamo.reset()
    assert ca_core.installed_runtime() is None
    yield
    # A compile a test left running in the background must not run into the next test.
    assert ca_runtime.wait_for_background_compiles(timeout=600)
    ca_core.uninstall_engine_hook()
    ca_runtime.reset()


@pytest.fixture(scope="session")
def cpp_ext() -> ModuleType:
    """C++ autograd Functions and a C++ tensor hook, as a user's C++ extension defines them.

    Built with ca_core (csrc/testing_helpers.cpp), so that no test environment
    compiles an extension of its own.
    """
    return ca_core._C._testing
