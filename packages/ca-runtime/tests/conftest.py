"""Shared fixtures: every differential test runs per backend, eager is the oracle."""

from __future__ import annotations

import ca_core
import ca_runtime
import pytest
import torch


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
    ca_core.uninstall_engine_hook()
    ca_runtime.reset()
