"""ds_report: which deepnvme ops this machine can build and run, in DeepSpeed's layout, and why not.

Gathering (:mod:`.collect`, :mod:`.checks`) and rendering (:mod:`.render`) are apart; this file holds the
command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from .collect import gather
from .render import Painter, render_json, render_text, want_colour

__all__ = ["cli_main", "gather", "main", "parse_args"]

# ----------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """DeepSpeed's two flags plus --json and --dir."""
    parser = argparse.ArgumentParser(
        prog="ds_report", description="Report which deepnvme ops this machine can build and run, and why not."
    )
    parser.add_argument(
        "--hide_operator_status", action="store_true", help="skip the op table (ninja, installed, compatible)"
    )
    parser.add_argument(
        "--hide_errors_and_warnings",
        action="store_true",
        help="do not print per-op reasons and environment warnings",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument(
        "--dir",
        default=os.getcwd(),
        help="directory in which to test O_DIRECT (default: the current directory)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, stream: TextIO | None = None) -> int:
    """Print the report; return 0 when async_io is usable (prebuilt or JIT compatible), 1 otherwise."""
    args = parse_args(argv)
    stream = stream or sys.stdout
    directory = os.path.abspath(args.dir)
    # The op table is needed for the exit status even when it is hidden from the output.
    report = gather(directory)
    if args.hide_operator_status:
        report.ops, report.ninja = None, None
    if args.json:
        stream.write(render_json(report, directory))
    else:
        stream.write(
            render_text(
                report,
                directory,
                Painter(want_colour(stream)),
                show_warnings=not args.hide_errors_and_warnings,
            )
        )
    stream.flush()
    return 0 if report.async_io_usable else 1


def cli_main() -> None:
    """Console-script entry point (`ds_report`)."""
    sys.exit(main())


if __name__ == "__main__":
    cli_main()
