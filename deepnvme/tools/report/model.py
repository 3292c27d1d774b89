"""What ds_report gathers and shows: findings (one capability line each), op rows and the whole report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Finding", "OpRow", "Report"]


@dataclass(frozen=True)
class Finding:
    """One capability line: what was found, and when it falls short, why and what to do."""

    key: str
    label: str
    ok: bool
    detail: str
    reason: str = ""
    fix: str = ""


@dataclass
class OpRow:
    """One row of the op table; reason says why an op is not compatible or why a prebuilt is not used."""

    name: str
    installed: bool
    compatible: bool
    reason: str = ""


@dataclass
class Report:
    """Everything ds_report shows, gathered once and rendered as text or JSON."""

    ninja: Finding | None
    ops: list[OpRow] | None
    environment: dict[str, Any]
    env_warnings: list[str]
    capabilities: list[Finding]
    async_io_usable: bool
    engines: list[str] = field(default_factory=list)
