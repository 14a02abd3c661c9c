"""The counters ``stats()`` reports: one table of each counter's name, meaning and source.

ca_core keeps the counters its engine hook bumps as C++ atomics (one table,
``kCounterFields`` in engine_hook.cpp, behind ``ca_core.counters()``); the
rest are Python's: graph breaks counted over the captured graphs
(``_state.py``, with the captures they are counted at), and the background
compiles and graph calls run uncompiled, which ``_background.py`` and
``_dynamo_direct.py`` bump here (``PYTHON_COUNTS``). ``COUNTERS`` names each once;
``stats()``, ``reset_counters()`` (through ``reset()``), the report's
overview and the README's table of ``stats()`` are read from or checked
against it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import ca_core

from ca_runtime._state import STATE

__all__ = ["COUNTERS", "PYTHON_COUNTS", "Counter", "PythonCounts", "reset_counters", "stats"]


class PythonCounts:
    """The counters only Python bumps (under the GIL, off the hit path but for ``uncompiled_runs``)."""

    def __init__(self) -> None:
        #: Inductor compiles started on a thread (``_background.py``).
        self.background_compiles = 0
        #: Graph calls run op by op: while their compile ran in the background
        #: (``_background.py``), or after a recompile failed on a hit
        #: (``_dynamo_direct.py``).
        self.uncompiled_runs = 0

    def reset(self) -> None:
        """Zeroes both."""
        self.background_compiles = 0
        self.uncompiled_runs = 0


#: The process's Python counters; see ``PythonCounts``.
PYTHON_COUNTS = PythonCounts()


@dataclasses.dataclass(frozen=True)
class Counter:
    """One counter of ``stats()``."""

    #: Its key in ``stats()``.
    name: str
    #: What it counts, as ``stats()``'s docstring and the README say it.
    meaning: str
    #: Its value, from ``ca_core.counters()`` (passed in, read once per ``stats()``) or Python's own counts.
    read: Callable[[Mapping[str, int]], int]


def _core(name: str) -> Callable[[Mapping[str, int]], int]:
    return lambda core: core[name]


#: Every counter of ``stats()``, in its order.
COUNTERS: tuple[Counter, ...] = (
    Counter("captures", "graphs captured and compiled", _core("captures")),
    Counter("cache_hits", "backwards served from the cache", _core("cache_hits")),
    Counter(
        "graph_breaks",
        "calls that run eagerly behind a graph break, summed over the captured graphs",
        lambda core: STATE.graph_breaks,
    ),
    Counter("eager_fallbacks", "backwards run wholly on the eager engine", _core("eager_fallbacks")),
    Counter(
        "background_compiles",
        "Inductor compiles started on a thread (compile_in_background)",
        lambda core: PYTHON_COUNTS.background_compiles,
    ),
    Counter(
        "uncompiled_runs",
        "graph calls run op by op: while their compile went on in the background, "
        "or because recompiling a cached graph failed",
        lambda core: PYTHON_COUNTS.uncompiled_runs,
    ),
    Counter(
        "eager_while_compiling",
        "backwards run on the eager engine while their graph compiled in the background",
        _core("eager_while_compiling"),
    ),
    Counter(
        "eager_if_faster_runs",
        "backwards at a cache entry run on the eager engine because its graph was not measurably "
        "faster, or to time it (enable(eager_if_faster=True))",
        _core("eager_if_faster_runs"),
    ),
    Counter(
        "eager_if_faster_without_walk",
        "of eager_if_faster_runs, those recognised without walking the graph",
        _core("eager_if_faster_without_walk"),
    ),
    Counter(
        "deferred_captures",
        "backwards run on the eager engine before their graph is captured: the first N - 1 under "
        "enable(capture_after=N) (by default the first of each graph), the first of a graph whose hooks name a hook registration or removal, "
        "and those gradcheck and gradgradcheck run",
        _core("deferred_captures"),
    ),
)


def stats() -> dict[str, int]:
    """Every counter of ``COUNTERS`` since the last ``reset()``."""
    core = ca_core.counters()
    return {counter.name: counter.read(core) for counter in COUNTERS}


def reset_counters() -> None:
    """Zeroes every counter (and ca_core's timings); forgets which graph breaks were warned about."""
    ca_core.reset_counters()
    STATE.reset()
    PYTHON_COUNTS.reset()
