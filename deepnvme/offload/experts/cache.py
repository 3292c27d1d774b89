"""The expert cache: Mixture-of-Experts experts read from the drive only when tokens are routed to them,
kept in a budget of locked memory with least-recently-used eviction.

Each expert is a key with its units in a `SwapSpace` (one unit per read request: in deepnvme's own store an
expert is one contiguous blob, so one unit). The cache has a `BufferPool` of its own (`capacity_bytes` of
locked memory): the dense units streamed beside it never wait on memory the cache holds, and the cache never
fragments their pool. Reads go through the space's read queue, so they share its order: queued prefetches
(the dense units read ahead, the experts a layer will need) wait behind a demanded expert.

A layer uses the cache in three calls: `request(keys)` once the gate has routed (counts each key a hit or a
miss and queues reads of the misses, in order, while there is room: evicting least-recently-used experts that
no layer holds), then for each key in the same order `acquire(key)` (demands its read, waits, returns the
`Lease`) and `release(key)` (the expert stays cached; reads of keys not yet issued start). A layer may
compute while an expert's check still runs: `acquire(key, checked=False)` returns once the bytes are read, and
`confirm(key, lease)` waits for the check before the layer lets its output go. Requests never
hold more than fits: a key whose read could not be issued is read at its `acquire`, once the keys before it
are released, so the capacity needs to hold only the largest expert.

A fourth call reads on a guess: `prefetch(keys)` (e.g. the experts the next layer's router picks for the
hidden state at hand) queues reads behind everything queued so far, only while the running layer's own
reads are all issued, and only into free room or room made by evicting an expert of the same layer that
nobody holds, requested or guessed (what other layers keep are the hits of the next tokens).
A guess never changes what a layer computes (the bytes are the store's either way); a wrong one costs its
read, which is counted (`stats()`: guessed_reads, guesses_used, guesses_wasted, wasted_bytes,
needed_bytes).

A fifth sets a read-ahead: `read_ahead(keys)` (the experts of the layers after the running one, in the order
they will run, for when nearly all of them are expected to be used) reads them in that order, as dense units
are read, whenever room is free or can be made: at once, and again at every `release`, until the next call
replaces the sequence. Its reads are guesses too (counted as above; `ahead_reads` of them). Room for one is
made only from experts nobody holds (in use, requested, or guessed and not used yet) whose next use comes
after it in the sequence, those outside it counting as needed last, the most recently used of them first
(the running layer's, just used): over a cycle of layers that reads more experts than the cache holds,
evicting the expert needed farthest ahead reads the fewest.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepnvme.offload._doors import new_handle
from deepnvme.offload.swap import BufferPool, Closing, Lease, SwapSpace, Unit, round_up


@dataclass
class _Entry:
    units: list[Unit]
    nbytes: int  # pool bytes its lease takes
    check: Callable[[Lease], None] | None
    lease: Lease | None = None
    group: Hashable = None  # the layer: eviction keeps each layer its share (see ExpertCache)
    reserved: bool = False  # requested by the layer running now, not acquired yet
    fresh: bool = False  # its read was issued for the use pending now (that use is a miss)
    in_use: int = 0  # acquired and not released
    guessed: bool = False  # read by prefetch() and not used since (its first use decides used or wasted)
    # Leases dropped from the cache while a holder still used them (a failed read or check): their memory
    # goes back once no one holds the expert, never under a holder's feet.
    orphans: list[Lease] = field(default_factory=list)


class ExpertCache(Closing):
    """Experts (keys, each a list of units of `space`) cached in `capacity_bytes` of locked memory of their
    own; see the module docstring for the calls a layer makes and `stats()` for what is counted.

    A use is a hit when the expert's bytes were in memory (or being read) before the layer asked for it, and
    a miss when it had to be read for this use. Eviction takes the least recently used expert that the
    running layer does not need; when only those are left, one the layer needs later but has not acquired
    yet (it is read again at its `acquire`); never one in use.

    Experts added with a `group` (their layer) are evicted least-recently-used within groups: a layer
    holding its share of the capacity (capacity / groups) or more gives up its own least recently used
    expert, else one of a layer over its share goes. Why: layers run in a cycle, and one least-recently-used
    list over all of them evicts, when the cache holds less than a token's experts, exactly the experts
    the next token's first layers come back for (no hits at all); per layer, each keeps its recent ones.
    """

    def __init__(self, space: SwapSpace, capacity_bytes: int, *, handle: Any = None) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise TypeError(f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
        self.space = space
        self.closed = True
        self.pool = BufferPool(capacity_bytes, handle if handle is not None else new_handle())
        self.closed = False
        self._entries: dict[Hashable, _Entry] = {}
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # resident or in flight, oldest first
        self._waiting: list[Hashable] = []  # requested keys whose reads are not issued yet, in order
        self._groups: set[Hashable] = set()
        self._guessing: set[Hashable] = set()  # the keys of the prefetch() running now
        self._requested: list[Hashable] = []  # the keys of the last request()
        self._ahead: dict[Hashable, int] = {}  # the read-ahead sequence (read_ahead()): key -> its place
        self._lock = threading.RLock()
        self.hits = self.misses = self.evictions = 0
        self.bytes_read = self.read_requests = self.tokens = 0
        self.needed_bytes = 0  # bytes of the reads a use needed: read on demand, or guessed and then used
        self.guessed_reads = self.guessed_bytes = self.guesses_used = self.guesses_wasted = 0
        self.wasted_bytes = self.ahead_reads = 0
        self.read_order: list[Hashable] = []  # keys in the order their reads were issued (the last 1024)

    # ------------------------------------------------------------------------------------------ setup
    def add(self, key: Hashable, units: Sequence[Unit], check: Callable[[Lease], None] | None = None, *,
            group: Hashable = None) -> None:
        """Register expert `key` as `units` (of layer `group`); `check(lease)` runs once on its bytes after
        each read (e.g. a CRC-32), on the space's check thread (SwapSpace.read): beside the next reads and the
        layer's compute, not on the caller's thread. `acquire` waits for it, or `confirm` does (see
        acquire's `checked`). ValueError when one expert exceeds the capacity."""
        if key in self._entries:
            raise ValueError(f"expert {key!r} is in the cache already")
        if not units:
            raise ValueError(f"expert {key!r} has no units")
        nbytes = Lease.size_of(units)
        if nbytes > self.pool.capacity:
            raise ValueError(f"expert {key!r} takes {nbytes} bytes of locked memory, more than the expert "
                             f"cache's {self.pool.capacity}: raise the budget by at least "
                             f"{nbytes - self.pool.capacity} bytes")
        self._entries[key] = _Entry(list(units), nbytes, check, group=group)
        if group is not None:
            self._groups.add(group)

    def expert_bytes(self, key: Hashable) -> int:
        """Bytes one read of `key` moves (its units' I/O ranges)."""
        return sum(u.io_nbytes for u in self._entry(key).units)

    # ----------------------------------------------------------------------------------- a layer's calls
    def request(self, keys: Sequence[Hashable]) -> None:
        """A layer needs `keys` (each once, in the order it will acquire them): queue reads of those not in
        memory, in that order, as far as room can be made without evicting what the layer needs."""
        with self._lock:
            self._check_open()
            self._unreserve()
            self._requested = list(keys)
            wanted = set(keys)
            groups = {self._entry(k).group for k in keys}
            for key in self._lru:  # guesses for these layers that the layer did not ask for were wrong
                entry = self._entries[key]
                if entry.guessed and entry.group in groups and key not in wanted:
                    self._waste(entry)
            for key in keys:
                entry = self._entry(key)
                entry.reserved = True
                if entry.lease is None:
                    self._waiting.append(key)
                else:
                    self._lru.move_to_end(key)
            self._issue_waiting()

    def acquire(self, key: Hashable, *, checked: bool = True) -> Lease:
        """The lease holding expert `key`'s bytes, read now if need be, demanded ahead of queued prefetches
        (release it with `release(key)`). With `checked` False it returns once the bytes are read, while
        their check (CRC-32) may still run: the caller computes with them meanwhile and calls
        `confirm(key, lease)` before anything computed from them leaves its hands (a check that has already
        ended is waited for here, so bytes known to be bad are never handed out)."""
        with self._lock:
            self._check_open()
            entry = self._entry(key)
            if key in self._waiting:
                self._waiting.remove(key)
            if entry.lease is None:
                self._issue(key, entry, hard=True)
            if entry.fresh:
                self.misses += 1
            else:
                self.hits += 1
            if entry.guessed:
                self.guesses_used += 1
                self.needed_bytes += self.expert_bytes(key)
            entry.fresh = entry.reserved = entry.guessed = False
            entry.in_use += 1
            lease = entry.lease
            self._lru.move_to_end(key)
        lease.demand()
        try:
            if checked or lease.done():
                lease.wait()  # the read, then its check
            else:
                lease.wait_reads()
        except BaseException:
            with self._lock:
                self._unhold(entry)
                self._drop(key, entry)  # a failed or damaged read is never served from the cache
            raise
        return lease

    def confirm(self, key: Hashable, lease: Lease) -> None:
        """Wait for the check of the bytes of `lease`, expert `key`'s as `acquire(key, checked=False)`
        returned it; when the check fails the expert leaves the cache (read again on its next use) and the
        check's error is raised. An interruption of the wait leaves the expert cached: its check's verdict
        is met by the next confirm or checked acquire. Still to be released with `release(key)`."""
        with self._lock:
            entry = self._entry(key)
            if entry.in_use <= 0:
                raise RuntimeError(f"expert {key!r} is not acquired")
        try:
            lease.wait()
        except BaseException:
            if lease.failed():
                with self._lock:
                    if entry.lease is lease:
                        self._drop(key, entry)  # a damaged read is never served from the cache
            raise

    def release(self, key: Hashable) -> None:
        """The layer is done with `key`: it stays cached (most recently used); waiting reads get issued."""
        with self._lock:
            self._unhold(self._entry(key))
            if not self.closed:
                self._issue_waiting()
                self._pump_ahead()

    def prefetch(self, keys: Sequence[Hashable], keep: Sequence[Hashable] = ()) -> bool:
        """Guess that `keys` will be requested soon: queue reads of those not in memory, in that order,
        behind every read queued so far, while room is free or can be made by evicting an expert of the
        same group (layer) that no layer holds, requested or was guessed to need, and that is not among
        `keys` or `keep` (likely needed too: not worth a read). Nothing is read while the running layer
        still waits for room for its own. True when every key is in memory or queued, False when one
        found no room (the rest are not tried)."""
        with self._lock:
            self._check_open()
            if self._waiting:
                return False
            self._guessing = {*keys, *keep}  # none of them makes room for another
            try:
                for key in keys:
                    entry = self._entry(key)
                    if entry.lease is None and not self._issue(key, entry, hard=False, guess=True):
                        return False
            finally:
                self._guessing = set()
            return True

    def read_ahead(self, keys: Sequence[Hashable]) -> None:
        """Read `keys` ahead in this order (see the module docstring): as far as room allows now, then at
        every `release`; replaces the sequence of the last call (an empty one stops the read-ahead; what it
        read stays cached)."""
        with self._lock:
            self._check_open()
            for key in keys:
                self._entry(key)
            self._ahead = {key: i for i, key in enumerate(keys)}
            self._pump_ahead()

    def count_tokens(self, n: int) -> None:
        """Add `n` tokens to the count bytes per token is measured over (the model's tokens, once each)."""
        with self._lock:
            self.tokens += int(n)

    # ------------------------------------------------------------------------------------------ memory
    def _pump_ahead(self) -> None:
        """Issue the read-ahead's next reads while room can be made for them, in order; never before the
        running layer's own reads are all issued."""
        if self._waiting:
            return
        for key in self._ahead:
            entry = self._entries[key]
            if entry.lease is None and not self._issue(key, entry, hard=False, guess=True, ahead=True):
                return

    def _evict_for_ahead(self, key: Hashable) -> bool:
        """Evict, for the read-ahead's `key`, the expert nobody holds whose next use in the sequence is
        farthest after key's; False if none's is after key's. Outside the sequence, the most recently used
        goes first: in a cycle of layers the one used last (the running layer's) is needed again last,
        while an earlier layer's, used before, comes back sooner."""
        place = self._ahead[key]
        victim, last = None, place
        for k in reversed(self._lru):
            e = self._entries[k]
            if e.in_use or e.reserved or e.guessed:
                continue
            at = self._ahead.get(k)
            if at is None:
                victim = k
                break
            if at > last:
                victim, last = k, at
        if victim is None:
            return False
        self._drop(victim, self._entries[victim])
        self.evictions += 1
        return True

    def _issue_waiting(self) -> None:
        while self._waiting:
            key = self._waiting[0]
            if not self._issue(key, self._entries[key], hard=False):
                return
            self._waiting.pop(0)

    def _issue(self, key: Hashable, entry: _Entry, hard: bool, guess: bool = False,
               ahead: bool = False) -> bool:
        """Queue the read of `key` (prefetch priority) once room is made by evicting least-recently-used
        experts: those the running layer does not need (a `guess` spares unused guesses too), and when
        `hard` (the key is wanted now) those it needs later; for the read-ahead (`ahead`, a guess), those
        `_evict_for_ahead` allows. False when no room can be made (never when `hard`: that raises)."""
        if ahead:
            within = self._between(key, entry, self._lru)
        else:
            within = None if guess else self._between(key, entry, self._requested)
        while True:
            lease = self.space.read(entry.units, block=False, pool=self.pool, within=within,
                                    check=entry.check)
            if lease is not None:
                break
            if ahead:
                if not self._evict_for_ahead(key):
                    return False
                continue
            if (not self._evict_one(entry, reserved=False, spare_guesses=guess)
                    and not (hard and self._evict_one(entry, reserved=True))):
                if not hard:
                    return False
                held = [k for k, e in self._entries.items() if e.in_use]
                raise RuntimeError(f"the expert cache ({self.pool.capacity} bytes) cannot hold expert "
                                   f"{key!r} ({entry.nbytes} bytes) while {held} are in use: release them "
                                   "first, or raise the budget")
        entry.lease, entry.fresh, entry.guessed = lease, not guess, guess
        self._lru[key] = None
        self._lru.move_to_end(key)
        nbytes = sum(u.io_nbytes for u in entry.units)
        self.bytes_read += nbytes
        if guess:
            self.guessed_reads += 1
            self.guessed_bytes += nbytes
            self.ahead_reads += ahead
        else:
            self.needed_bytes += nbytes
        self.read_requests += len(lease.tickets)
        self.read_order.append(key)
        del self.read_order[:-1024]
        return True

    def _between(self, key: Hashable, entry: _Entry, among: Iterable[Hashable]) -> tuple[int, int] | None:
        """Where in the pool an expert's read should go: after the resident experts of its layer among
        `among` (the running layer's requested ones; for the read-ahead, every cached one) of lower keys and
        before those of higher keys, so that the layer's experts lie in key order (a fused experts module
        then takes them as one strided view instead of a copy). Only a preference for free room: eviction
        never deviates from its policy for it (tried: steering the victim to the right place cost more
        cache hits than the copies it saved)."""
        lo, hi = 0, self.pool.capacity
        try:
            for k in among:
                other = self._entries[k]
                if k == key or other.lease is None or other.group != entry.group:
                    continue
                buf = other.lease.buffer
                if k < key:  # type: ignore[operator]
                    lo = max(lo, buf.start + buf.nbytes)
                else:
                    hi = min(hi, buf.start)
        except TypeError:  # keys without an order
            return None
        return (lo, hi) if lo < hi else None

    def _evict_one(self, incoming: _Entry, reserved: bool, spare_guesses: bool = False) -> bool:
        """Evict one expert to make room for `incoming` (see the class docstring); False if none can go.
        Unused guesses go only when nothing else can. With `spare_guesses` (room for a guess) never a
        guess, and only an expert of the guessed layer's own group: the others are this cache's hits
        for the next tokens, which a wrong guess must not cost."""
        free = [k for k in self._lru
                if self._entries[k].in_use == 0 and self._entries[k].reserved == reserved]
        candidates = [k for k in free if not self._entries[k].guessed]
        if spare_guesses:
            candidates = [k for k in candidates if k not in self._guessing
                          and (incoming.group is None or self._entries[k].group == incoming.group)]
        if not candidates and not spare_guesses:
            candidates = free
        if not candidates:
            return False
        victim = candidates[0]
        if len(self._groups) > 1 and incoming.group is not None:
            share = self.pool.capacity / len(self._groups)
            held: dict[Hashable, int] = {}
            for k in self._lru:
                held[self._entries[k].group] = held.get(self._entries[k].group, 0) + self._entries[k].nbytes
            own = [k for k in candidates if self._entries[k].group == incoming.group]
            over = [k for k in candidates if held[self._entries[k].group] > share]
            if own and held[incoming.group] + incoming.nbytes > share:
                victim = own[0]
            elif over:
                victim = over[0]
        entry = self._entries[victim]
        self._drop(victim, entry)
        if reserved and victim not in self._waiting:  # read again at its acquire
            self._waiting.append(victim)
        self.evictions += 1
        return True

    def _waste(self, entry: _Entry) -> None:
        """A guess that no layer used: its read counts as wasted."""
        entry.guessed = False
        self.guesses_wasted += 1
        self.wasted_bytes += sum(u.io_nbytes for u in entry.units)

    def _drop(self, key: Hashable, entry: _Entry) -> None:
        if entry.guessed:  # evicted (or cleared) before any use
            self._waste(entry)
        lease, entry.lease, entry.fresh = entry.lease, None, False
        self._lru.pop(key, None)
        if lease is not None:
            if entry.in_use:
                entry.orphans.append(lease)  # another holder still reads it: released at its release
            else:
                lease.release()  # waits for a read still in flight before the memory goes back

    def _unhold(self, entry: _Entry) -> None:
        """One holder less; with none left, the leases dropped under the holders go back."""
        entry.in_use = max(entry.in_use - 1, 0)
        if not entry.in_use:
            self._release_orphans(entry)

    @staticmethod
    def _release_orphans(entry: _Entry) -> None:
        orphans, entry.orphans = entry.orphans, []
        for lease in orphans:
            lease.release()

    # ------------------------------------------------------------------------------------------ reporting
    def cached(self) -> list[Hashable]:
        """Keys resident or being read, least recently used first."""
        with self._lock:
            return list(self._lru)

    def stats(self) -> dict[str, Any]:
        """hits, misses, hit_rate (hits / uses), evictions, bytes_read, read_requests, tokens,
        bytes_per_token (bytes_read / tokens, None before any token), capacity_bytes, cached_bytes; of
        the reads on a guess (prefetch): guessed_reads, guessed_bytes, guesses_used (a use found the
        guess; it counts as a hit too), guesses_wasted (the layer ran without it, or it was evicted
        unused), wasted_bytes, and needed_bytes (the bytes of the reads that served a use: read on demand,
        or guessed and then used; bytes_read less the guesses wasted or not used yet); ahead_reads: the
        guessed reads that were the read-ahead's (read_ahead())."""
        with self._lock:
            uses = self.hits + self.misses
            return {
                "hits": self.hits,
                "misses": self.misses,
                "hit_rate": self.hits / uses if uses else None,
                "evictions": self.evictions,
                "bytes_read": self.bytes_read,
                "read_requests": self.read_requests,
                "tokens": self.tokens,
                "bytes_per_token": self.bytes_read / self.tokens if self.tokens else None,
                "capacity_bytes": self.pool.capacity,
                "cached_bytes": sum(self._entries[k].nbytes for k in self._lru),
                "guessed_reads": self.guessed_reads,
                "guessed_bytes": self.guessed_bytes,
                "guesses_used": self.guesses_used,
                "guesses_wasted": self.guesses_wasted,
                "wasted_bytes": self.wasted_bytes,
                "needed_bytes": self.needed_bytes,
                "ahead_reads": self.ahead_reads,
            }

    def _entry(self, key: Hashable) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"no expert {key!r} in this expert cache") from None

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the expert cache is closed")

    def clear(self) -> None:
        """Give every cached expert's memory back (waits for reads in flight); counters are kept."""
        with self._lock:
            for key in list(self._lru):
                self._drop(key, self._entries[key])
            self._unreserve()

    def _unreserve(self) -> None:
        """Forget what the last request left unacquired (a layer interrupted halfway, by an error or
        Ctrl-C): those experts stay cached as any other, and a read done for them counts as a hit later."""
        for entry in self._entries.values():
            if entry.reserved:
                entry.reserved = entry.fresh = False
        self._waiting = []

    def close(self) -> None:
        """Release every lease and free the locked memory (idempotent). The space is the caller's."""
        if getattr(self, "closed", True):
            return
        self._ahead = {}
        self.clear()
        for entry in self._entries.values():  # closing ends every use: what holders kept goes too
            self._release_orphans(entry)
        self.closed = True
        self.pool.close()


def capacity_for(units_per_expert: Sequence[Sequence[Unit]]) -> int:
    """The least capacity that holds the largest of these experts (whole pages)."""
    return max((round_up(Lease.size_of(u)) for u in units_per_expert), default=0)
