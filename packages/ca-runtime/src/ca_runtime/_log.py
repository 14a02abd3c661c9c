"""The ``ca_runtime`` logger and the warning categories of eager execution."""

from __future__ import annotations

import logging

__all__ = ["EagerFallbackWarning", "GraphBreakWarning", "log"]

log = logging.getLogger("ca_runtime")


class EagerFallbackWarning(UserWarning):
    """A backward (or part of it) ran on the eager engine instead of compiled."""


class GraphBreakWarning(UserWarning):
    """Part of a compiled backward runs eagerly behind a graph break (once per node and reason)."""
