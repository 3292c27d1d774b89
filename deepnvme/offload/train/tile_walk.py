"""The walk of an offloaded optimizer's step over its tiles (a mixin of OffloadedOptimizer): each tile's
state read ahead through the pool, stepped, written back, in order."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from deepnvme.offload.swap import ReadAhead, Ticket
from deepnvme.offload.train.profile import StepProfile

if TYPE_CHECKING:
    from deepnvme.offload.train.optimizer import OffloadedOptimizer

    _Base = OffloadedOptimizer
else:
    _Base = object

Piece = tuple[int, torch.Tensor, int]  # (group index, parameter, chunk index: 0 when whole)

# Requests each direction serves at once: with one, the drive idles while each request's last blocks
# complete and the queue issues the next; with two, the next is already in the drive.
REQUESTS_IN_FLIGHT = 2
# Requests the first and the last tile move in (each way): the tile that starts the pipeline and the one
# that ends it, where nothing else is left to overlap with, fill every slot of the queue (see ReadAhead).
END_REQUESTS = REQUESTS_IN_FLIGHT


class TileWalk(_Base):
    """_reader and _run_tiles of OffloadedOptimizer."""

    def _reader(self, tiles: list[list[Piece]]) -> ReadAhead:
        """The reads of `tiles`' state, in order, issued as far ahead as the pool allows."""
        return ReadAhead(self.swap, [[u for _, p, k in t if p in self._records
                                      for u in self._records[p].units[k]] for t in tiles],
                         end_parts=END_REQUESTS)

    def _run_tiles(self, work: list[tuple[int, torch.Tensor]], tiles: list[list[Piece]], lending: Any,
                   reader: ReadAhead | None = None) -> StepProfile:
        """Step `tiles` of `work`, each tile's state read ahead (by `reader`, when its reads were issued
        before); `lending` gives offloaded parameters' values (lending.py). An error leaves the optimizer
        refusing further steps (`_broken`)."""
        reader = self._reader(tiles) if reader is None else reader
        starts = {p: self._records[p].scalars for _, p in work if p in self._records}
        self._made = {p for _, p in work if p in self._records and self._records[p].made}
        self._flat_grads = {}
        self._broken = "a step() was interrupted"
        profile = StepProfile(time.perf_counter())
        writes: list[Ticket] = []
        try:
            for i, tile in enumerate(tiles):
                waited = time.perf_counter()
                lease = reader.take(i)
                began = time.perf_counter()
                profile.read_wait_s += began - waited
                profile.tile_reads_queued.append(min(t.queued for t in lease.tickets)
                                                 if lease is not None and lease.tickets else None)
                if lease is not None:
                    profile.add_requests(lease.tickets)
                try:
                    self._lent = lending.take(i)
                    fresh = self._step_tile(tile, lease, starts)
                except BaseException:
                    if lease is not None:
                        lease.release()
                    raise
                profile.updates.append((began, time.perf_counter(),
                                        sum(p.numel() * p.element_size() for _, p, _ in tile)))
                if lease is not None:
                    writes += lease.write_back(END_REQUESTS if i == len(tiles) - 1 else 1)
                lending.give_back(i)
                if fresh:  # state made in memory: stored once the memory read ahead is given back
                    reader.restart(i + 1)
                    self._store_fresh(fresh)
            lending.done()
            self.swap.wait_writes()
            profile.add_requests(writes)
            profile.ended = time.perf_counter()
        except BaseException as exc:
            reader.close()
            lending.close()
            try:
                self.swap.wait_writes()
            except OSError:
                pass
            self._broken = (f"a step() ended by {type(exc).__name__}: {exc}" if str(exc)
                            else f"a step() ended by {type(exc).__name__}")
            raise
        finally:
            self._flat_grads, self._lent = {}, {}
        self._broken = None
        return profile
