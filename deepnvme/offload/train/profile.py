"""StepProfile: what one step of the offloaded optimizer moved, and when (the pipeline made visible)."""

from __future__ import annotations

from dataclasses import dataclass, field

from deepnvme.offload.swap import Ticket

Span = tuple[float, float, int]  # (began, ended, bytes), time.perf_counter() seconds


@dataclass
class StepProfile:
    """What one step() did and when: a span per read request, per piece update, per write request, and the
    time the step waited for reads. Overlap of these spans is the pipeline at work."""

    began: float
    ended: float = 0.0
    reads: list[Span] = field(default_factory=list)
    updates: list[Span] = field(default_factory=list)  # bytes: the tile's parameters' bytes
    writes: list[Span] = field(default_factory=list)
    read_wait_s: float = 0.0
    #: When each tile's reads were queued (None for a tile with nothing to read): before the update of the
    #: tile ahead of it began, where the read-ahead works.
    tile_reads_queued: list[float | None] = field(default_factory=list)

    @property
    def bytes_read(self) -> int:
        """Bytes the step read from the drive."""
        return sum(n for *_, n in self.reads)

    @property
    def bytes_written(self) -> int:
        """Bytes the step wrote to the drive: what it wears (every swapped byte once per step)."""
        return sum(n for *_, n in self.writes)

    def add_requests(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            (self.writes if t.write else self.reads).append((t.began, t.ended, t.tensor.numel()))
