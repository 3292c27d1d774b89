"""ds_report's rendering: DeepSpeed's text layout (with optional colour) or one JSON object."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any, TextIO

from deepnvme._version import __version__

from .model import Finding, Report

__all__ = ["Painter", "render_json", "render_text", "want_colour"]

GREEN = "\033[92m"
RED = "\033[91m"
YELLOW = "\033[93m"
END = "\033[0m"

# DeepSpeed's column widths, kept so a DeepSpeed user's eye (and their grep) finds everything in place.
OP_NAME_WIDTH = 23
MARKER_WIDTH = 11
ENV_NAME_WIDTH = 33
SEPARATOR = "-" * (OP_NAME_WIDTH + MARKER_WIDTH + len("op name") + len("installed"))
# A probe's reason may end with the compiler's output; the text view keeps only its last lines (JSON has all).
TEXT_TAIL_LINES = 4

# Text labels for the environment keys, in display order; JSON keeps the snake_case keys.
ENV_LABELS = {
    "torch_install_path": "torch install path",
    "torch_version": "torch version",
    "deepnvme_install_path": "deepnvme install path",
    "deepnvme_info": "deepnvme info",
    "torch_cuda_version": "torch cuda version",
    "nvcc_version": "nvcc version",
    "deepnvme_wheel_compiled_w": "deepnvme wheel compiled w.",
    "shm_size": "shared memory (/dev/shm) size",
}



# ----------------------------------------------------------------------------------------------------
# Rendering


class Painter:
    """Colours markers only when asked to; keeps the plain text identical otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, colour: str) -> str:
        """Wrap text in an ANSI colour when enabled."""
        return f"{colour}{text}{END}" if self.enabled else text


def want_colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set to a non-empty value (no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _dots(label: str, width: int) -> str:
    """Dot leader for DeepSpeed's layout; at least one dot so long plugin names still read as a row."""
    return "." * max(1, width - len(label))


def _marker(finding: Finding, paint: Painter) -> str:
    """[OKAY] when fine, [WARNING] when usable with a caveat, [NO] when missing."""
    if finding.ok and not finding.reason:
        return paint("[OKAY]", GREEN)
    if finding.ok:
        return paint("[WARNING]", YELLOW)
    return paint("[FAIL]", RED) if finding.key == "async_io_engines" else paint("[NO]", YELLOW)


def _wrapped(prefix: str, text: str, indent: int) -> list[str]:
    """A possibly multi-line reason under its prefix; compiler output is cut to its last lines."""
    first, *rest = text.strip().splitlines() or [""]
    lines = [f"{prefix}{first}"]
    if len(rest) > TEXT_TAIL_LINES:
        more = len(rest) - TEXT_TAIL_LINES
        lines.append(" " * indent + f"... ({more} more lines in deepnvme report --json)")
        rest = rest[-TEXT_TAIL_LINES:]
    return lines + [" " * indent + ln.strip() for ln in rest]


def render_text(report: Report, directory: str, paint: Painter, show_warnings: bool) -> str:
    """DeepSpeed's op table and environment block, then deepnvme's capability lines."""
    out: list[str] = []
    okay, no, yes = paint("[OKAY]", GREEN), paint("[NO]", YELLOW), paint("[YES]", GREEN)
    if report.ops is not None and report.ninja is not None:
        out += [
            SEPARATOR,
            "deepnvme C++/CUDA extension op report",
            SEPARATOR,
            "NOTE: an op that is not installed (prebuilt) is compiled just in",
            "      time (JIT) on its first load(). 'compatible' means this machine",
            "      has everything that JIT build of the op needs.",
            SEPARATOR,
            "JIT compiled ops requires ninja",
            f"ninja {'.' * 18} {okay if report.ninja.ok else paint('[FAIL]', RED)}",
            SEPARATOR,
            "op name ................ installed .. compatible",
            SEPARATOR,
        ]
        for row in report.ops:
            installed = "[YES]" if row.installed else "[NO]"
            shown = yes if row.installed else no
            out.append(
                f"{row.name} {_dots(row.name, OP_NAME_WIDTH)} {shown} "
                f"{'.' * (MARKER_WIDTH - len(installed))} {okay if row.compatible else no}"
            )
            if row.reason and show_warnings:
                out += _wrapped(f" {paint('[WARNING]', YELLOW)} {row.name}: ", row.reason, 6)
        out.append(SEPARATOR)

    out.append("deepnvme general environment info:")
    env = report.environment
    for key, label in ENV_LABELS.items():
        if key not in env:
            continue
        value = env[key]
        if key == "nvcc_version" and value is None:
            value = paint("[FAIL] nvcc not found or unreadable; set CUDA_HOME", RED)
        elif key == "deepnvme_wheel_compiled_w" and value is None:
            value = "none (no prebuilt ops; every op is JIT compiled)"
        out.append(f"{label} {_dots(label, ENV_NAME_WIDTH)} {value}")
    if show_warnings:
        out += [paint(f" [WARNING] {w}", YELLOW) for w in report.env_warnings]

    out += [SEPARATOR, f"deepnvme I/O capabilities (O_DIRECT tested in {directory})", SEPARATOR]
    for cap in report.capabilities:
        out.append(
            f"{cap.label} {_dots(cap.label, ENV_NAME_WIDTH)} {_marker(cap, paint)} {cap.detail}".rstrip()
        )
        if cap.reason:
            out += _wrapped("    reason: ", cap.reason, 12)
        if cap.fix:
            out += _wrapped("    fix:    ", cap.fix, 12)
    out.append(SEPARATOR)
    return "\n".join(out) + "\n"


def render_json(report: Report, directory: str, tool: dict[str, Any]) -> str:
    """The same content as one JSON object: whose report it is (`tool`), ops, environment, capabilities, and
    the verdict on async_io."""
    doc: dict[str, Any] = {"tool": tool, "deepnvme_version": __version__, "dir": directory}
    if report.ops is not None and report.ninja is not None:
        doc["ninja"] = report.ninja.ok
        doc["ops"] = [asdict(r) for r in report.ops]
    doc["environment"] = report.environment
    doc["warnings"] = report.env_warnings
    doc["capabilities"] = [asdict(c) for c in report.capabilities]
    doc["async_io_usable"] = report.async_io_usable
    doc["async_io_engines"] = report.engines
    return json.dumps(doc, indent=2) + "\n"
