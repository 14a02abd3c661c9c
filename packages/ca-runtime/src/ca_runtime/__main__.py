"""``python -m ca_runtime``: command-line tools of ca_runtime.

``python -m ca_runtime report [--open] [--from DATA.json] [-o OUT.html]``
renders the report of the last run saved with ``CA_REPORT`` (see
``ca_runtime.report``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ca_runtime._report import cli, report_at_exit


def main(argv: Sequence[str] | None = None) -> int:
    # Rendering a report must not write this process's (empty) one at exit.
    report_at_exit.cancel()
    parser = argparse.ArgumentParser(prog="python -m ca_runtime", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cli.add_arguments(
        commands.add_parser(
            "report", help="render the HTML report of a run saved with CA_REPORT", description=cli.DESCRIPTION
        )
    )
    args = parser.parse_args(argv)
    cli.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
