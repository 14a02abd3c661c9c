"""The counters of ``stats()`` come from one table (``_counters.COUNTERS``) that the README and the report follow."""

from __future__ import annotations

import re
from pathlib import Path

import ca_core
import ca_runtime
import pytest
import torch
from ca_runtime._counters import COUNTERS
from ca_runtime._report.model import build_report_data

README = Path(__file__).resolve().parents[3] / "README.md"
NAMES = [counter.name for counter in COUNTERS]


def _backward() -> None:
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()


def test_stats_has_one_key_per_counter_in_the_tables_order() -> None:
    assert list(ca_runtime.stats()) == NAMES
    assert len(set(NAMES)) == len(NAMES)


def test_every_core_counter_is_reported_or_internal() -> None:
    """ca_core's counters (kCounterFields) are in stats() but for nodes_put_back, a diagnostic of the hit path."""
    assert set(ca_core.counters()) - set(NAMES) == {"nodes_put_back"}


def test_reset_zeroes_every_counter_and_the_report_shows_stats() -> None:
    ca_runtime.reset()
    with ca_runtime.enable("eager", capture_after=1):
        _backward()
        _backward()
    counted = ca_runtime.stats()
    assert counted["captures"] == 1 and counted["cache_hits"] == 1
    assert build_report_data().counters == counted
    ca_runtime.reset()
    assert set(ca_runtime.stats().values()) == {0}


def test_the_readmes_stats_table_lists_the_counters_in_order() -> None:
    if not README.is_file():
        pytest.skip(f"not run from a checkout ({README} is missing)")
    section = README.read_text().split("**`stats()`**", 1)[1].split("\n\n**", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE) == NAMES
