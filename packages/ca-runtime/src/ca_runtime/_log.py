"""The ``ca_runtime`` logger and the warning categories of eager execution."""

from __future__ import annotations

import logging
import os

__all__ = ["EagerFallbackWarning", "GraphBreakWarning", "log", "miss_log"]

log = logging.getLogger("ca_runtime")
#: One INFO line per capture after the first: where and why the cache missed.
miss_log = logging.getLogger("ca_runtime.misses")


def _configure_from_env() -> None:
    """``CA_LOGS=misses`` (comma-separated) prints the miss explanations to stderr."""
    wanted = {part.strip() for part in os.environ.get("CA_LOGS", "").split(",")}
    if "misses" in wanted and not miss_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        miss_log.addHandler(handler)
        miss_log.setLevel(logging.INFO)


_configure_from_env()


class EagerFallbackWarning(UserWarning):
    """A backward (or part of it) ran on the eager engine instead of compiled."""


class GraphBreakWarning(UserWarning):
    """Part of a compiled backward runs eagerly behind a graph break (once per node and reason)."""
