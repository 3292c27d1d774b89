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

from deepnvme.tools.cli import human_out
from deepnvme.tools.ownership import banner, identity

from .collect import gather
from .render import Painter, render_json, render_text, want_colour

__all__ = ["SHARED_NAME", "cli_main", "gather", "main", "parse_args"]

SHARED_NAME = "ds_report"  # the console script DeepSpeed installs too

# ----------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None, prog: str = SHARED_NAME) -> argparse.Namespace:
    """DeepSpeed's two flags plus --json and --dir."""
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=banner(prog, SHARED_NAME)
        + "\nReport which deepnvme ops this machine can build and run, and why not.",
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


def main(argv: Sequence[str] | None = None, stream: TextIO | None = None, prog: str = SHARED_NAME) -> int:
    """Print the report; return 0 when async_io is usable (prebuilt or JIT compatible), 1 otherwise.

    The first line says whose report this is (on stderr with --json, where the document has a "tool" field).
    """
    args = parse_args(argv, prog)
    stream = stream or sys.stdout
    # With --json the stream carries the document alone, so the line goes where the tools' readable lines go.
    print(banner(prog, SHARED_NAME), file=human_out(True) if args.json else stream, flush=True)
    directory = os.path.abspath(args.dir)
    # The op table is needed for the exit status even when it is hidden from the output.
    report = gather(directory)
    if args.hide_operator_status:
        report.ops, report.ninja = None, None
    if args.json:
        stream.write(render_json(report, directory, identity(prog, SHARED_NAME)))
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
