"""ca_runtime: compiled autograd for stock torch.

Inside ``enable(compiler_fn)``, ``loss.backward()`` is captured once (when its
graph comes back: ``capture_after``) into an FX graph, compiled with
``compiler_fn`` and served from a cache on later steps;
what cannot be compiled runs on the eager engine with one warning.

[Note: How a backward flows through ca_runtime]
The Python half of the map whose C++ half is [Note: How a backward flows
through ca_core] (ca_core.h). One module per step, in the order a backward
meets them:

- ``_enable.py``: ``enable()`` resolves ``compiler_fn`` (``_compiler_key.py``
  names the cache it serves from), makes a ``Runtime`` and installs it as
  ca_core's engine hook, restoring the previous hook on exit.
- ca_core walks the graph; on a hit it calls the stored compiled callable and
  nothing here runs but that callable (for a ``torch.compile`` result,
  Dynamo's cached code called directly once its guards pass:
  ``_dynamo_direct.py``).
- On a miss, ``Runtime.capture`` (``_runtime.py``, [Note: Capture methods]):
  ``_capture.py`` writes the engine's loop out as an FX graph, each node as
  its rule in ``_node_rules.py`` says (traced, a graph break, unsupported),
  out of the calls in ``_graph_ops.py`` (node applies, output checks, leaf
  accumulation, hook calls, the user-error tag); a checkpoint region's
  recompute is one op (``_checkpoint.py``), a ``torch.compile``d region's
  backward is copied in (``_aot.py``). ``_node_runs.py`` fuses runs of node
  calls into one; then ``compiler_fn`` compiles it (``create_graph=True``
  graphs with Dynamo's eager backend, Inductor with ``_inductor_passes.py``
  and, in the background, ``_background.py``).
- ``Runtime.run_first`` makes the first call, where a lazy compiler does its
  work; a failure there runs the backward eagerly with one warning
  (``_log.py``), a user's error is raised unchanged.
- What Python alone knows (graph breaks, the last graph, records for
  ``report()``) is process state in ``_state.py`` and ``_report/``; every
  private torch API the Python side uses is in ``_torch_interop.py``.
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
from ca_runtime._cache_entry import EagerIfFasterChoice  # noqa: E402
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
    "EagerIfFasterChoice",
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
