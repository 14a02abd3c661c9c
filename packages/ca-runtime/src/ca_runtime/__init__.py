"""ca_runtime: compiled autograd for stock torch.

Inside ``enable(compiler_fn)``, ``loss.backward()`` is captured once into an FX
graph, compiled with ``compiler_fn`` and served from a cache on later steps;
what cannot be compiled runs on the eager engine with one warning.
"""

from __future__ import annotations

from ca_runtime._capture import build_graph_module
from ca_runtime._enable import CacheEntry, cache_clear_failed, cache_info, disable, enable, reset, stats
from ca_runtime._log import EagerFallbackWarning, GraphBreakWarning
from ca_runtime._runtime import Runtime, last_graph

__all__ = [
    "CacheEntry",
    "EagerFallbackWarning",
    "GraphBreakWarning",
    "Runtime",
    "build_graph_module",
    "cache_clear_failed",
    "cache_info",
    "disable",
    "enable",
    "last_graph",
    "reset",
    "stats",
]

__version__ = "0.1.0"
