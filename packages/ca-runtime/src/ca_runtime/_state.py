"""The Python side's process-wide state, in one place and under one lock.

ca_core keeps its counters (captures, hits, fallbacks) as C++ atomics; what
only Python knows lives here: graph breaks counted over the captured graphs,
the most recent captured graph (``last_graph()``) and which breaks were
already warned about. Captures can happen on several threads at once (two
threads' backwards missing together), so every change takes the lock. None of
it is touched on the cache-hit path.

The rest of the Python side's process-wide state lives beside the code that
needs its own lock or lifetime, each listed here so that this is where to
look: the counters ``stats()`` reports (``_counters.py``, the one table of
them); the compiler keys and the captures per compiler (``_compiler_key.py``,
under an RLock because a compiler's weakref callback may fire while it is
held); the background compile threads, their thread-local start marks and
the interpreter's switch interval while they run (``_background.py``); the
engine-hook state ``enable()`` saves and restores (``_enable.py``); the
prologues of copied AOT backwards (``_aot.py``, a WeakKeyDictionary that dies
with each Function class); direct-call counts for the bench
(``_dynamo_direct.py``); what ``report()`` shows (``RECORDER`` in
``_report/records.py``: the report's own log of the runtime's captures and
fallbacks, under its own lock), whether it collects timings and the report
written at exit (``_report/``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ca_runtime._capture import GraphBreak

__all__ = ["STATE", "RuntimeState"]


class RuntimeState:
    """See the module docstring; ``reset()`` (``ca_runtime.reset``) empties it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Graph breaks in the graphs captured since the last reset.
        self.graph_breaks = 0
        #: The FX graph of the most recent capture.
        self.last_graph: torch.fx.GraphModule | None = None
        #: (node name, reason) of every break already warned about.
        self._warned_breaks: set[tuple[str, str]] = set()

    def record_capture(self, graph: torch.fx.GraphModule, breaks: Sequence[GraphBreak]) -> list[GraphBreak]:
        """Counts a captured graph's breaks; returns those not warned about before."""
        with self._lock:
            self.last_graph = graph
            self.graph_breaks += len(breaks)
            new = [b for b in breaks if (b.node_name, b.reason) not in self._warned_breaks]
            self._warned_breaks.update((b.node_name, b.reason) for b in new)
            return new

    def set_last_graph(self, graph: torch.fx.GraphModule) -> None:
        with self._lock:
            self.last_graph = graph

    def reset(self) -> None:
        with self._lock:
            self.graph_breaks = 0
            self.last_graph = None
            self._warned_breaks.clear()


STATE = RuntimeState()
