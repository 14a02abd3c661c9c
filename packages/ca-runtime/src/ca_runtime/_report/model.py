"""The report's data: everything ``ca_runtime.report()`` shows, as plain data, and its JSON form.

``build_report_data()`` gathers it from ca_core (counters, timings, the cache
tree) and from what the runtime recorded on the miss path
(``RECORDER``'s log, see ``records.py``). The HTML renderer (``html.py``)
only reads a ``ReportData``; ``python -m ca_runtime report --from DATA.json``
re-renders one read back with ``ReportData.from_json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import importlib.metadata
import os
import sys
import types
import typing
from collections import Counter
from typing import Any, TypeVar

import ca_core
import torch

from ca_runtime._cache_entry import CacheEntry
from ca_runtime._counters import stats
from ca_runtime._report import records
from ca_runtime._report.records import CaptureRecord, FallbackRecord, ReasonKind, Stage

__all__ = [
    "FORMAT_VERSION",
    "ReportData",
    "build_report_data",
    "set_timings_enabled",
    "timings_enabled",
]

#: Version of the JSON layout; ``from_json`` refuses another.
FORMAT_VERSION = 1
#: Reasons listed per kind in the overview.
TOP_REASONS = 8


@dataclasses.dataclass
class ReportData:
    """Everything one report shows."""

    created: str
    command: str
    pid: int
    versions: dict[str, str]
    #: ``ca_runtime.stats()``.
    counters: dict[str, int]
    #: ``ca_core.timings()`` (walk_ns, lookup_ns, run_ns, finish_ns, hook_ns, timed_backwards, keys_hashed), or
    #: None when timings were not collected.
    timings: dict[str, int] | None
    #: Seconds per miss-path stage.
    seconds: dict[Stage, float]
    #: Per kind: the most frequent reasons and their counts.
    top_reasons: dict[ReasonKind, list[tuple[str, int]]]
    #: Every node of the cache, each compiler's tree depth-first (parents first).
    cache_tree: list[CacheEntry]
    #: The latest captures and fallbacks, oldest first.
    captures: list[CaptureRecord]
    fallbacks: list[FallbackRecord]
    #: Records made since the last reset (more than listed when over record_limit).
    num_captures: int
    num_fallbacks: int
    record_limit: int
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReportData:
        """A ReportData from ``to_json()``'s output (as read back from a JSON file)."""
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"report data has format version {version!r}, this ca_runtime reads {FORMAT_VERSION}"
            )
        return _from_json(cls, data)


_T = TypeVar("_T")


def _from_json(cls: type[_T], data: Any) -> _T:
    """``data`` (JSON values) converted to ``cls``, a dataclass, following its field types."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    return cls(**{f.name: _convert(hints[f.name], data[f.name]) for f in fields if f.name in data})


def _convert(hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        return _convert(next(a for a in args if a is not type(None)), value)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _from_json(hint, value)
    if origin is list:
        return [_convert(args[0], v) for v in value]
    if origin is tuple:
        return tuple(_convert(a, v) for a, v in zip(args, value))
    if origin is dict:
        return {_convert(args[0], k): _convert(args[1], v) for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    return value


class _TimingSwitch:
    """Whether ca_core times the walk, runs and finish of each backward; see ``collect_timings``."""

    enabled = False


def set_timings_enabled(enabled: bool) -> None:
    ca_core.set_timing(enabled)
    _TimingSwitch.enabled = enabled


def timings_enabled() -> bool:
    return _TimingSwitch.enabled


def _top(counts: Counter[str] | None) -> list[tuple[str, int]]:
    return [] if counts is None else counts.most_common(TOP_REASONS)


def _versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for dist in ("ca-core", "ca-runtime"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "unknown"
    return versions


def build_report_data() -> ReportData:
    """The report of this process: counters, timings, cache tree and the recorded captures."""
    log = records.RECORDER.snapshot()
    timings = ca_core.timings()
    return ReportData(
        created=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        command=" ".join(sys.argv) or sys.executable,
        pid=os.getpid(),
        versions=_versions(),
        counters=stats(),
        timings=dict(timings) if _TimingSwitch.enabled or timings["timed_backwards"] else None,
        seconds=dict(log.seconds),
        top_reasons={kind: _top(log.reasons.get(kind)) for kind in ReasonKind},
        cache_tree=[CacheEntry.of(n) for n in ca_core.cache_tree()],
        captures=list(log.captures),
        fallbacks=list(log.fallbacks),
        num_captures=log.num_captures,
        num_fallbacks=log.num_fallbacks,
        record_limit=log.captures.maxlen or records.REPORT_LIMIT,
    )
