"""The ``deepnvme`` command (also ``python -m deepnvme``): the tools under a name only deepnvme installs.

``ds_report``, ``ds_io`` and ``ds_nvme_tune`` are names DeepSpeed installs too, and whichever package pip
installed last owns them; ``deepnvme report|io|tune`` always run deepnvme's. Each subcommand takes the same
options and exits with the same status as the tool it runs; ``deepnvme SUBCOMMAND --help`` lists them. A
subcommand's module is imported only when it runs, so ``deepnvme --help`` is quick and loads no torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from deepnvme._version import __version__
from deepnvme.tools.cli import EXIT_USAGE

__all__ = ["SUBCOMMANDS", "Subcommand", "main"]

PROG = "deepnvme"


@dataclass(frozen=True)
class Subcommand:
    """A tool behind a subcommand: the module whose ``main(argv, prog=...)`` runs it."""

    module: str
    summary: str
    shared_name: str | None = None  # the console script of the same tool, a name DeepSpeed installs too


SUBCOMMANDS = {
    "report": Subcommand("deepnvme.tools.report", "which ops this machine can build and run, and why not",
                         "ds_report"),
    "io": Subcommand("deepnvme.tools.ds_io", "time tensor reads or writes with DeepSpeed's ds_io flags",
                     "ds_io"),
    "tune": Subcommand("deepnvme.tools.tune", "search the aio_handle settings that reach a drive's speed",
                       "ds_nvme_tune"),
    "demo": Subcommand("deepnvme.tools.demo", "one tensor through aio_handle beside torch.save/torch.load"),
}


def usage() -> str:
    """The top-level help: the subcommands, and which ds_* name runs the same tool when deepnvme owns it."""
    width = max(map(len, SUBCOMMANDS))
    shared = max(len(sub.shared_name or "") for sub in SUBCOMMANDS.values())
    rows = [f"  {name:<{width}}  {sub.shared_name or '':<{shared}}  {sub.summary}"
            for name, sub in SUBCOMMANDS.items()]
    return "\n".join([
        f"usage: {PROG} {{{','.join(SUBCOMMANDS)}}} [options]   (or: python -m deepnvme ...)",
        "",
        f"deepnvme {__version__}'s tools, under a name no other package installs.",
        "",
        "subcommands, with the ds_* name that runs the same tool while deepnvme owns it (DeepSpeed installs",
        "those names too; whichever package pip installed last owns them):",
        *rows,
        "",
        "options:",
        "  -h, --help  show this help and exit",
        "  --version   print deepnvme's version and exit",
        "",
        f"`{PROG} SUBCOMMAND --help` lists a subcommand's options.",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the subcommand named first in argv with the rest; its exit status is ours. A missing or unknown
    subcommand exits with status 2, as any bad command line does."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args and args[0] == "--version":
        print(f"deepnvme {__version__}")
        return 0
    if not args or args[0] not in SUBCOMMANDS:
        problem = f"unknown subcommand {args[0]!r}" if args else "a subcommand is required"
        print(f"{usage()}\n\n{PROG}: error: {problem} (choose from {', '.join(SUBCOMMANDS)})",
              file=sys.stderr)
        return EXIT_USAGE
    name, rest = args[0], args[1:]
    tool = importlib.import_module(SUBCOMMANDS[name].module)
    return tool.main(rest, prog=f"{PROG} {name}")
