"""ca_runtime: compiled autograd for stock torch.

Inside ``enable(compiler_fn)``, ``loss.backward()`` is captured once into an FX
graph, compiled with ``compiler_fn`` and served from a cache on later steps;
what cannot be compiled runs on the eager engine with one warning.
"""

from __future__ import annotations

import importlib.metadata


def _check_ca_core() -> None:
    """ca-runtime is released with exactly one ca-core (its pin); fail at import on any other."""
    import re

    pin = next(
        (r for r in importlib.metadata.requires("ca-runtime") or () if re.match(r"ca[-_]core\s*==", r)), None
    )
    if pin is None:
        return
    wanted = pin.split("==", 1)[1].strip()
    try:
        installed = importlib.metadata.version("ca-core")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    # ca-core's version carries the torch it is bound to as a local label
    # ("0.1.0+torch2.13.0"); a pin without a label ignores it, as pip does.
    if installed is None or installed.split("+", 1)[0] != wanted:
        raise ImportError(
            f"ca_runtime {importlib.metadata.version('ca-runtime')} needs ca-core=={wanted}, but "
            + ("ca-core is not installed" if installed is None else f"ca-core {installed} is installed")
            + f". Install the matching one: `pip install ca-core=={wanted}` (from a checkout: "
            "`pip install --no-build-isolation packages/ca-core packages/ca-runtime`)."
        )


_check_ca_core()

from ca_runtime._background import wait_for_background_compiles  # noqa: E402
from ca_runtime._capture import build_graph_module  # noqa: E402
from ca_runtime._enable import (  # noqa: E402
    CacheEntry,
    cache_clear_failed,
    cache_info,
    disable,
    enable,
    replace_torch,
    reset,
    stats,
)
from ca_runtime._log import EagerFallbackWarning, GraphBreakWarning, RecompileWarning  # noqa: E402
from ca_runtime._report import _arm_from_environment, collect_timings, report  # noqa: E402
from ca_runtime._runtime import Runtime, last_graph  # noqa: E402

__all__ = [
    "CacheEntry",
    "EagerFallbackWarning",
    "GraphBreakWarning",
    "RecompileWarning",
    "Runtime",
    "build_graph_module",
    "cache_clear_failed",
    "cache_info",
    "collect_timings",
    "disable",
    "enable",
    "last_graph",
    "replace_torch",
    "report",
    "reset",
    "stats",
    "wait_for_background_compiles",
]

__version__ = importlib.metadata.version("ca-runtime")  # from pyproject.toml, its one source

# CA_REPORT=PATH: after _enable's exit hook is registered, so the report is written before it runs.
_arm_from_environment()
