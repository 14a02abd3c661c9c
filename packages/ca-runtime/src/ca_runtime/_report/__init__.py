"""``ca_runtime.report()``: one self-contained HTML page about every backward of this process.

The page (``html.py``) shows counters and times, the shadow-graph cache as a
tree, each captured graph drawn with its nodes coloured by how they ran
(``layout.py``), its FX code and lifted inputs, the timeline of cache misses
with their explanations, and every graph break and eager fallback. Its data
(``model.py``) is written next to it as JSON, which
``python -m ca_runtime report --from DATA.json`` renders again (``cli.py``).

What it shows is recorded on the miss path only (``records.py``); the walk,
run and finish times of every backward come from ca_core's timers, which are
off unless ``collect_timings()`` or ``CA_REPORT`` turns them on, so the
cache-hit path costs nothing extra without a report.

``CA_REPORT=PATH`` (read when ``ca_runtime`` is imported) turns the timers on
and writes the report to PATH when the process exits; ``{pid}`` in PATH is
replaced by the process id (several processes, e.g. DDP ranks, would
otherwise write the same file). A process that ran no backward under
compiled autograd writes nothing.

The package is private (``ca_runtime._report``); its public face is
``ca_runtime.report()`` and ``ca_runtime.collect_timings()``.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import sys

from ca_runtime._report.html import render
from ca_runtime._report.layout import LAYOUTS
from ca_runtime._report.model import ReportData, build_report_data, set_timings_enabled

__all__ = ["collect_timings", "last_report_pointer", "report", "report_at_exit", "write_report"]

#: The environment variable naming the report written at exit.
ENV_VAR = "CA_REPORT"


def collect_timings(enabled: bool = True) -> None:
    """Times the walk, the compiled runs and the finish of every backward for ``report()``.

    Off by default (the cache-hit path then does no timing at all); ``CA_REPORT``
    turns it on. ``reset()`` zeroes the times. Capture, compile and first-run
    times are recorded whether or not this is on (they are on the miss path).
    """
    set_timings_enabled(enabled)


def last_report_pointer() -> pathlib.Path:
    """The small JSON file that names the last report written at exit (``$XDG_CACHE_HOME/ca_runtime/``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(cache) / "ca_runtime" / "last-report.json"


def write_report(data: ReportData, path: str | os.PathLike[str], layout: str = "auto") -> pathlib.Path:
    """Writes ``data`` as HTML to ``path`` and as JSON next to it (``path`` with suffix ``.json``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    html_path = pathlib.Path(path).expanduser().resolve()
    html_path.parent.mkdir(parents=True, exist_ok=True)
    page = render(data, layout)
    json_path = html_path.with_suffix(".json")
    if json_path == html_path:
        raise ValueError(f"the report path must not end in .json: {html_path}")
    json_path.write_text(json.dumps(data.to_json(), indent=1) + "\n", encoding="utf-8")
    html_path.write_text(page, encoding="utf-8")
    return html_path


def report(path: str | os.PathLike[str] = "ca-report.html", *, layout: str = "auto") -> pathlib.Path:
    """Writes the HTML report of every backward since the last ``reset()``; returns its path.

    One self-contained page (no network: CSS, JavaScript and SVG inline) plus
    its data as JSON next to it (``path`` with suffix ``.json``).
    ``layout``: ``auto`` draws graphs with graphviz ``dot`` when installed,
    else with a built-in layered layout; ``dot`` or ``builtin`` forces one.
    """
    return write_report(build_report_data(), path, layout)


class _ExitReport:
    """The report ``CA_REPORT`` asks for, written at exit (before the cache is emptied)."""

    def __init__(self) -> None:
        self.path: str | None = None

    def arm(self, path: str) -> None:
        if self.path is None:
            # Registered after ca_runtime._enable's _release_at_exit, so it runs
            # before it (atexit runs in reverse order): the cache is still there.
            atexit.register(self.write)
        self.path = path

    def cancel(self) -> None:
        """No report at exit (the CLI, which renders reports, must not overwrite one)."""
        self.path = None

    def write(self) -> None:
        if self.path is None:
            return
        data = build_report_data()
        if not (data.captures or data.fallbacks or any(data.counters.values())):
            return  # no backward ran under compiled autograd: keep the last real report
        try:
            written = write_report(data, self.path.replace("{pid}", str(os.getpid())))
        except Exception as e:  # noqa: BLE001 - at exit: say why, do not print a traceback
            print(f"ca_runtime: could not write the report to {self.path}: {e}", file=sys.stderr)
            return
        pointer = last_report_pointer()
        try:
            pointer.parent.mkdir(parents=True, exist_ok=True)
            pointer.write_text(
                json.dumps({"html": str(written), "json": str(written.with_suffix(".json"))}) + "\n",
                encoding="utf-8",
            )
        except OSError:
            pass  # the report is written; only `python -m ca_runtime report` will not find it by itself
        print(f"ca_runtime: report written to {written}", file=sys.stderr)


report_at_exit = _ExitReport()


def _arm_from_environment() -> None:
    """``CA_REPORT=PATH``: timings on, and the report written to PATH at exit."""
    path = os.environ.get(ENV_VAR)
    if path:
        collect_timings()
        report_at_exit.arm(path)
