"""The ``ca_runtime`` logger and the warning category of eager fallbacks."""

from __future__ import annotations

import logging

__all__ = ["EagerFallbackWarning", "log"]

log = logging.getLogger("ca_runtime")


class EagerFallbackWarning(UserWarning):
    """A backward (or part of it) ran on the eager engine instead of compiled."""
