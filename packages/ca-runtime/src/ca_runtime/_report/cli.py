"""``python -m ca_runtime report``: renders a saved report's data again as HTML, and opens it.

Without ``--from`` it renders the last report ``CA_REPORT`` wrote at exit,
found through the pointer file ``last_report_pointer()`` names.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import webbrowser

from ca_runtime._report import last_report_pointer
from ca_runtime._report.html import render
from ca_runtime._report.layout import LAYOUTS
from ca_runtime._report.model import ReportData

__all__ = ["DESCRIPTION", "add_arguments", "run"]

DESCRIPTION = (
    "Render the HTML report of a run again from its JSON data: by default the last report written "
    "with CA_REPORT=out.html, else --from DATA.json."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--from",
        dest="data",
        type=pathlib.Path,
        help="the report's JSON data (default: the last report written with CA_REPORT)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=pathlib.Path,
        help="the HTML file to write (default: the data file with suffix .html)",
    )
    parser.add_argument("--open", action="store_true", help="open the report in a web browser")
    parser.add_argument(
        "--layout", choices=LAYOUTS, default="auto", help="graph drawing: graphviz dot, built-in, or auto"
    )


def _last_data() -> pathlib.Path:
    pointer = last_report_pointer()
    try:
        return pathlib.Path(json.loads(pointer.read_text(encoding="utf-8"))["json"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(
            f"no saved report found ({pointer}: {e}); run your script with CA_REPORT=out.html first, "
            "or pass --from DATA.json"
        ) from None


def run(args: argparse.Namespace) -> pathlib.Path:
    """Renders the report the arguments name; returns the HTML file written."""
    data_path: pathlib.Path = args.data or _last_data()
    try:
        data = ReportData.from_json(json.loads(data_path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"cannot read report data {data_path}: {e}") from None
    output: pathlib.Path = (args.output or data_path.with_suffix(".html")).expanduser().resolve()
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render(data, args.layout), encoding="utf-8")
    print(output)
    if args.open:
        webbrowser.open(output.as_uri())
    return output
