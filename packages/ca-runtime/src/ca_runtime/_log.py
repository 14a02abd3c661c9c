"""The ``ca_runtime`` logger and the warning categories of eager execution."""

from __future__ import annotations

import logging
import os
import sys
import warnings

import ca_core
import torch

from ca_runtime._torch_interop import register_ca_logs

__all__ = [
    "EagerFallbackWarning",
    "GraphBreakWarning",
    "RecompileWarning",
    "describe_error",
    "log",
    "miss_log",
    "warn_at_user_line",
]

log = logging.getLogger("ca_runtime")
#: One INFO line per capture after the first: where and why the cache missed.
miss_log = logging.getLogger("ca_runtime.misses")


#: What ``CA_LOGS`` accepts.
CA_LOGS_VALUES = frozenset({"misses"})


def _configure_from_env() -> None:
    """Where ca_runtime's logs go, from the environment.

    ``CA_LOGS=misses`` (comma-separated) prints the miss explanations to
    stderr. Code written for torch's compiled autograd reads
    ``TORCH_LOGS=compiled_autograd``: it prints the same miss explanations and
    ca_runtime's INFO lines (captures' breaks, fallbacks, choices), and
    ``TORCH_LOGS=compiled_autograd_verbose`` adds each captured graph's code
    (DEBUG). ``torch._logging.set_logs(ca=logging.INFO)`` works as for any
    torch log (the ``ca`` log is registered with torch).
    """
    wanted = {part.strip() for part in os.environ.get("CA_LOGS", "").split(",")} - {""}
    if unknown := sorted(wanted - CA_LOGS_VALUES):
        warnings.warn(
            f"CA_LOGS: {', '.join(map(repr, unknown))} ignored; it accepts "
            f"{', '.join(sorted(CA_LOGS_VALUES))} (comma-separated); TORCH_LOGS=compiled_autograd "
            "prints all of ca_runtime's logs",
            UserWarning,
            stacklevel=2,
        )
    torch_wanted, torch_verbose = register_ca_logs()
    for logger, on, level in (
        (miss_log, "misses" in wanted or torch_wanted or torch_verbose, logging.INFO),
        (log, torch_wanted or torch_verbose, logging.DEBUG if torch_verbose else logging.INFO),
    ):
        if on and not logger.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(level)
            logger.propagate = False


_configure_from_env()


class EagerFallbackWarning(UserWarning):
    """A backward (or part of it) ran on the eager engine instead of compiled."""


class GraphBreakWarning(UserWarning):
    """Part of a compiled backward runs eagerly behind a graph break (once per node and reason)."""


class RecompileWarning(UserWarning):
    """A backward is captured and compiled again that an equivalent compiler had compiled already."""


#: Frames in these directories are ours or torch's: a warning names the first frame outside them.
_INTERNAL_DIRS = (
    os.path.dirname(__file__) + os.sep,
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(ca_core.__file__) + os.sep,
)


def warn_at_user_line(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the user's line that led here (their ``backward()`` call).

    The stack between that line and us is ca_runtime's and torch's (autograd's
    ``backward``, Dynamo's frames); Python 3.11 has no ``skip_file_prefixes``,
    so the level is counted here. Only on warning paths, never on a hit.
    """
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(message, category, stacklevel=level + 1 if frame is not None else 2)


def describe_error(error: BaseException) -> str:
    """``Type: first line``, followed by the same for its cause (Dynamo wraps backend errors)."""
    parts: list[str] = []
    seen: BaseException | None = error
    while seen is not None and len(parts) < 3:
        lines = str(seen).strip().splitlines()
        parts.append(f"{type(seen).__name__}: {lines[0] if lines else ''}".rstrip(": "))
        seen = seen.__cause__ or getattr(seen, "inner_exception", None)
    return " <- ".join(parts)
