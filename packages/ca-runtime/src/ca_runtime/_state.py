"""The Python side's process-wide state, in one place and under one lock.

ca_core keeps its counters (captures, hits, fallbacks) as C++ atomics; what
only Python knows lives here: graph breaks counted over the captured graphs,
the most recent captured graph (``last_graph()``) and which breaks were
already warned about, and what ``report()`` shows (``ReportLog``: the latest
captures and fallbacks, running totals). Captures can happen on several
threads at once (two threads' backwards missing together), so every change
takes the lock. None of it is touched on the cache-hit path.

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
(``_dynamo_direct.py``); whether ``report()`` collects timings and the report
written at exit (``_report/``).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ca_runtime._capture import GraphBreak
    from ca_runtime._report.records import CaptureRecord, FallbackRecord, Stage

__all__ = ["REPORT_LIMIT", "STATE", "ReportLog", "RuntimeState"]

#: Captures (and fallbacks) ``report()`` shows: the latest ones.
REPORT_LIMIT = 200


class ReportLog:
    """What ``ca_runtime.report()`` shows, recorded on the miss path (see ``_report/records.py``).

    The latest ``REPORT_LIMIT`` capture and fallback records, plus totals that
    count every one since the last reset: seconds per stage and how often each
    (normalised) break, fallback and miss reason occurred.
    """

    def __init__(self) -> None:
        self.captures: deque[CaptureRecord] = deque(maxlen=REPORT_LIMIT)
        self.fallbacks: deque[FallbackRecord] = deque(maxlen=REPORT_LIMIT)
        #: Records made since the reset (the deques keep the latest).
        self.num_captures = 0
        self.num_fallbacks = 0
        #: Seconds spent per stage.
        self.seconds: dict[Stage, float] = {}
        #: Per kind ("break", "fallback", "miss"): how often each reason occurred.
        self.reasons: dict[str, Counter[str]] = {}


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
        #: What report() shows.
        self.report_log = ReportLog()

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

    # -- what report() shows ---------------------------------------------------

    def add_capture_record(self, record: CaptureRecord) -> None:
        """Stores ``record`` (its id is set here); the oldest one goes beyond REPORT_LIMIT."""
        with self._lock:
            log = self.report_log
            log.num_captures += 1
            record.id = log.num_captures
            log.captures.append(record)

    def add_fallback_record(self, record: FallbackRecord) -> None:
        with self._lock:
            log = self.report_log
            log.num_fallbacks += 1
            record.id = log.num_fallbacks
            log.fallbacks.append(record)

    def add_seconds(self, stage: Stage, seconds: float) -> None:
        with self._lock:
            seconds_by_stage = self.report_log.seconds
            seconds_by_stage[stage] = seconds_by_stage.get(stage, 0.0) + seconds

    def count_reasons(self, kind: str, reasons: Iterable[str]) -> None:
        with self._lock:
            self.report_log.reasons.setdefault(kind, Counter()).update(reasons)

    def report_snapshot(self) -> ReportLog:
        """A copy of the report log (the records themselves are shared, not copied)."""
        with self._lock:
            log = self.report_log
            copy = ReportLog()
            copy.captures = deque(log.captures, maxlen=log.captures.maxlen)
            copy.fallbacks = deque(log.fallbacks, maxlen=log.fallbacks.maxlen)
            copy.num_captures, copy.num_fallbacks = log.num_captures, log.num_fallbacks
            copy.seconds = dict(log.seconds)
            copy.reasons = {kind: Counter(counts) for kind, counts in log.reasons.items()}
            return copy

    def reset(self) -> None:
        with self._lock:
            self.graph_breaks = 0
            self.last_graph = None
            self._warned_breaks.clear()
            self.report_log = ReportLog()


STATE = RuntimeState()
