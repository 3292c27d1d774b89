"""The expert cache on the real disk: only requested experts are read, least-recently-used eviction inside the
capacity, hit rate and bytes per token, guesses and the read-ahead counted and kept inside the capacity, a
demanded expert ahead of queued prefetches (checked by the order the read thread completes requests, never by
timing), and failed reads never served from the cache."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path

import pytest
import torch

from deepnvme.offload import SwapSpace
from deepnvme.offload._doors import PAGE
from deepnvme.offload.experts import ExpertCache
from deepnvme.offload.swap import DEMAND, Ticket

EXPERT = 3 * PAGE  # one expert: one contiguous blob of three pages
N = 6


@pytest.fixture()
def store(workdir: Path) -> tuple[Path, torch.Tensor]:
    """A file of N expert blobs, expert i filled with bytes of its own."""
    data = torch.randint(0, 256, (N * EXPERT,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    path = workdir / "experts.bin"
    path.write_bytes(data.numpy().tobytes())
    return path, data


def make(space: SwapSpace, path: Path, capacity_experts: int) -> ExpertCache:
    cache = ExpertCache(space, capacity_experts * EXPERT)
    for i in range(N):
        cache.add(i, [space.add_external(f"e{i}", path, i * EXPERT, EXPERT, pool=cache.pool)])
    return cache


def use(cache: ExpertCache, keys: list[int], data: torch.Tensor) -> None:
    """What a layer does: request, then acquire/check/release each key in order."""
    cache.request(keys)
    for k in keys:
        lease = cache.acquire(k)
        assert torch.equal(lease.view(f"e{k}"), data[k * EXPERT:(k + 1) * EXPERT])
        cache.release(k)


class HeldCheck:
    """A check that waits for `gate` (set: it does not wait) and then passes or fails by the next of
    `verdicts` ("good"/"bad"); `started` is set when a check begins."""

    def __init__(self, *verdicts: str) -> None:
        self.verdicts = list(verdicts)
        self.gate, self.started = threading.Event(), threading.Event()

    def __call__(self, _lease: object) -> None:
        self.started.set()
        self.gate.wait(60)
        if self.verdicts.pop(0) == "bad":
            raise ValueError("CRC-32 mismatch (test)")


def test_only_requested_experts_are_read_and_lru_evicts(store: tuple[Path, torch.Tensor],
                                                        workdir: Path) -> None:
    path, data = store
    with SwapSpace(workdir, PAGE) as space, make(space, path, 3) as cache:
        use(cache, [0, 1], data)
        assert cache.read_order == [0, 1] and cache.read_requests == 2
        assert cache.bytes_read == 2 * EXPERT
        use(cache, [2], data)
        use(cache, [0], data)  # a hit: 0 becomes the most recently used
        assert cache.cached() == [1, 2, 0]
        use(cache, [3], data)  # full: the least recently used (1) goes
        assert cache.cached() == [2, 0, 3]
        use(cache, [4, 0], data)  # 2 goes for 4; 0 stays (a hit)
        assert cache.cached() == [3, 4, 0]
        assert cache.read_order == [0, 1, 2, 3, 4]
        assert cache.pool.in_use <= 3 * EXPERT
        s = cache.stats()
        assert (s["hits"], s["misses"], s["evictions"]) == (2, 5, 2)
        assert s["hit_rate"] == pytest.approx(2 / 7)
        assert s["bytes_read"] == 5 * EXPERT and s["read_requests"] == 5
        assert s["bytes_per_token"] is None
        cache.count_tokens(10)
        assert cache.stats()["bytes_per_token"] == pytest.approx(5 * EXPERT / 10)


def test_eviction_keeps_each_layer_its_share(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    """Experts of two layers (groups), room for two: a layer at its share gives up its own least recently
    used expert, not the other layer's (which one list over both layers would evict)."""
    path, data = store
    with SwapSpace(workdir, PAGE) as space, ExpertCache(space, 2 * EXPERT) as cache:
        for i in range(N):
            cache.add(i, [space.add_external(f"e{i}", path, i * EXPERT, EXPERT, pool=cache.pool)],
                      group="a" if i < 3 else "b")
        use(cache, [0], data)
        use(cache, [1], data)
        use(cache, [3], data)  # b holds nothing: a is over its share, its least recently used (0) goes
        assert cache.cached() == [1, 3]
        use(cache, [1], data)  # a hit: 3 is now the least recently used overall
        use(cache, [2], data)  # a is at its share: its own 1 goes, b's 3 stays
        assert cache.cached() == [3, 2]
        use(cache, [3], data)
        assert cache.stats()["hits"] == 2 and cache.stats()["evictions"] == 2


def test_capacity_of_one_expert_evicts_a_later_need(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    """A layer needing more experts than fit: the ones it needs later are read at their turn, never a
    deadlock, never wrong bytes."""
    path, data = store
    with SwapSpace(workdir, PAGE) as space, make(space, path, 1) as cache:
        use(cache, [0, 1, 2], data)
        use(cache, [2, 0], data)  # 2 is a hit; 0 evicts it after use
        use(cache, [0, 2], data)
        assert cache.pool.in_use <= EXPERT
        s = cache.stats()
        assert s["hits"] == 2 and s["misses"] == 5


def test_demanded_expert_overtakes_queued_prefetches(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    path, data = store
    with SwapSpace(workdir, 2 * EXPERT + PAGE) as space, make(space, path, 4) as cache:
        dense = [space.add_external(f"d{i}", path, i * EXPERT, EXPERT) for i in range(2)]
        # Hold the read thread on one request, so everything after it queues.
        gate = threading.Event()
        hold = space.pool.acquire(PAGE)
        first = space.reads.submit(Ticket(hold.tensor, space._ext[str(path)], 0, str(path), False,
                                          lambda _t: gate.wait()))
        order: list[str] = []
        dense_leases = [space.read([u]) for u in dense]  # the dense units read ahead: prefetches
        cache.request([1, 2, 3])  # the layer's experts: prefetches too, behind the dense ones
        leases = {k: cache._entries[k].lease for k in (1, 2, 3)}
        for name, lease in [("d0", dense_leases[0]), ("d1", dense_leases[1])] + [
                (f"e{k}", le) for k, le in leases.items()]:
            for t in lease.tickets:
                t.on_done = lambda _t, name=name: order.append(name)
        got: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: got.append(cache.acquire(3).view("e3").clone()))
        worker.start()
        demanded = threading.Event()
        while not demanded.wait(0.005):  # until the worker's demand reached the queue (no timing asserted)
            if leases[3].tickets[0].priority == DEMAND or not worker.is_alive():
                demanded.set()
        gate.set()
        worker.join()
        first.wait()
        for le in dense_leases:
            le.wait()
            le.release()
        hold.release()
        for k in (1, 2):
            for t in leases[k].tickets:
                t.settle()
        assert order[0] == "e3", order
        assert order[1:] == ["d0", "d1", "e1", "e2"], order
        assert torch.equal(got[0], data[3 * EXPERT:4 * EXPERT])
        cache.release(3)
        for k in (1, 2):
            cache.acquire(k)
            cache.release(k)


def test_failed_check_is_not_cached(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    path, data = store
    bad = {"once": True}

    def check(_lease: object) -> None:
        if bad.pop("once", False):
            raise ValueError("CRC-32 mismatch (test)")

    with SwapSpace(workdir, PAGE) as space, ExpertCache(space, 2 * EXPERT) as cache:
        cache.add("x", [space.add_external("x", path, 0, EXPERT, pool=cache.pool)], check)
        cache.request(["x"])
        with pytest.raises(ValueError, match="CRC-32 mismatch"):
            cache.acquire("x")
        assert cache.cached() == [] and cache.pool.in_use == 0
        use_lease = cache.acquire("x")  # read again, checked again
        assert torch.equal(use_lease.view("x"), data[:EXPERT])
        cache.release("x")
        assert cache.stats()["read_requests"] == 2


def test_unchecked_acquire_then_confirm(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    """acquire(checked=False) hands the bytes over once they are read while their check still runs (held
    here on an event), so a layer computes beside it; confirm() returns only after the check, and a failed
    check raises there and drops the expert from the cache: its next use reads it again."""
    path, data = store
    check = HeldCheck("bad", "good")
    gate, started, verdicts = check.gate, check.started, check.verdicts
    with SwapSpace(workdir, PAGE) as space, ExpertCache(space, 2 * EXPERT) as cache:
        cache.add("x", [space.add_external("x", path, 0, EXPERT, pool=cache.pool)], check)
        cache.request(["x"])
        try:
            lease = cache.acquire("x", checked=False)
            assert torch.equal(lease.view("x"), data[:EXPERT])  # read, not yet checked
            assert started.wait(60) and not lease.done()
            outcome: list[BaseException | None] = []

            def confirm() -> None:
                try:
                    cache.confirm("x", lease)
                    outcome.append(None)
                except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                    outcome.append(exc)

            waiter = threading.Thread(target=confirm)
            waiter.start()
            waiter.join(0.2)
            assert waiter.is_alive() and not outcome  # the check cannot end before the gate opens
        finally:
            gate.set()  # never leave the check thread waiting (closing the cache joins it)
        waiter.join(60)
        assert isinstance(outcome[0], ValueError) and "CRC-32 mismatch" in str(outcome[0])
        cache.release("x")
        assert cache.cached() == [] and cache.pool.in_use == 0
        lease = cache.acquire("x")  # read again, checked again (it passes now)
        assert torch.equal(lease.view("x"), data[:EXPERT])
        cache.release("x")
        assert cache.stats()["read_requests"] == 2 and not verdicts
        with pytest.raises(RuntimeError, match="not acquired"):
            cache.confirm("x", lease)


def test_failed_check_never_handed_out_unchecked(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    """An expert acquired unchecked and released without confirm (its layer was interrupted) whose check
    then fails is not handed out again, checked or not: the next acquire raises the check's error and the
    expert leaves the cache."""
    path, data = store
    check = HeldCheck("bad", "bad", "good")
    gate, verdicts = check.gate, check.verdicts
    with SwapSpace(workdir, PAGE) as space, ExpertCache(space, 2 * EXPERT) as cache:
        cache.add("x", [space.add_external("x", path, 0, EXPERT, pool=cache.pool)], check)
        try:
            for checked in (False, True):
                cache.request(["x"])
                lease = cache.acquire("x", checked=False)
                cache.release("x")  # no confirm: the layer never got that far
                gate.set()
                concurrent.futures.wait([lease.checked])
                with pytest.raises(ValueError, match="CRC-32 mismatch"):
                    cache.acquire("x", checked=checked)
                assert cache.cached() == [] and cache.pool.in_use == 0
                gate.clear()
        finally:
            gate.set()
        lease = cache.acquire("x")
        assert torch.equal(lease.view("x"), data[:EXPERT])
        cache.release("x")
        assert not verdicts


def test_failed_check_with_two_holders_keeps_memory_until_both_release(store: tuple[Path, torch.Tensor],
                                                                       workdir: Path) -> None:
    """Two holders of one expert whose check fails: the expert leaves the cache at the first confirm, but
    its memory stays theirs until both release it (a new read of it goes elsewhere in the pool, never over
    bytes a holder still reads), and the second holder's confirm fails too."""
    path, data = store
    check = HeldCheck("bad", "good")
    gate, verdicts = check.gate, check.verdicts
    with SwapSpace(workdir, PAGE) as space, ExpertCache(space, 2 * EXPERT) as cache:
        cache.add("x", [space.add_external("x", path, 0, EXPERT, pool=cache.pool)], check)
        cache.request(["x"])
        try:
            first = cache.acquire("x", checked=False)
            second = cache.acquire("x", checked=False)  # the check is held: both hold unchecked bytes
        finally:
            gate.set()
        assert first is second and cache._entries["x"].in_use == 2
        with pytest.raises(ValueError, match="CRC-32 mismatch"):
            cache.confirm("x", first)
        assert cache.cached() == [] and cache.pool.in_use == EXPERT  # still held by both
        again = cache.acquire("x")  # read anew (checked: good), beside the held bytes
        assert again is not first and cache.pool.in_use == 2 * EXPERT
        assert torch.equal(again.view("x"), data[:EXPERT])
        with pytest.raises(ValueError, match="CRC-32 mismatch"):
            cache.confirm("x", second)
        cache.release("x")
        cache.release("x")
        assert cache.pool.in_use == 2 * EXPERT  # the third use still holds the new read
        cache.release("x")
        assert cache.pool.in_use == EXPERT and cache.cached() == ["x"]  # the new read stays cached
        assert not verdicts


def test_bad_arguments(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    path, _ = store
    with SwapSpace(workdir, EXPERT) as space, ExpertCache(space, 2 * PAGE) as cache:
        with pytest.raises(ValueError, match="expert 'big' takes 12288 bytes.*cache's 8192"):
            cache.add("big", [space.add_external("big", path, 0, EXPERT)])
        with pytest.raises(KeyError, match="no expert 'nope'"):
            cache.request(["nope"])
        with pytest.raises(TypeError, match="capacity_bytes must be an int"):
            ExpertCache(space, 1.5)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="closed"):
        cache.request([])


def grouped(space: SwapSpace, path: Path, capacity_experts: int) -> ExpertCache:
    """Experts 0-2 of layer "a", 3-5 of layer "b"."""
    cache = ExpertCache(space, capacity_experts * EXPERT)
    for i in range(N):
        cache.add(i, [space.add_external(f"e{i}", path, i * EXPERT, EXPERT, pool=cache.pool)],
                  group="a" if i < 3 else "b")
    return cache


def test_guesses_are_counted_used_or_wasted(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    """A guess read (prefetch) that the layer then uses is a hit and needed bytes; one the layer runs
    without is wasted; the bytes of both are in bytes_read, and the layer's bytes are the store's."""
    path, data = store
    with SwapSpace(workdir, PAGE) as space, grouped(space, path, 4) as cache:
        use(cache, [0], data)
        assert cache.prefetch([3, 4])  # layer b's guess, read into free room
        assert cache.read_order == [0, 3, 4]
        use(cache, [3, 5], data)  # 3 was right, 4 was not, 5 is read on demand
        s = cache.stats()
        assert (s["guessed_reads"], s["guesses_used"], s["guesses_wasted"]) == (2, 1, 1)
        assert (s["hits"], s["misses"]) == (1, 2)
        assert s["bytes_read"] == 4 * EXPERT and s["guessed_bytes"] == 2 * EXPERT
        assert s["wasted_bytes"] == EXPERT and s["needed_bytes"] == 3 * EXPERT
        assert cache.prefetch([0])  # in memory already: nothing read
        assert cache.stats()["guessed_reads"] == 2
        use(cache, [4], data)  # a wasted guess still cached serves a later use (a plain hit)
        assert cache.stats()["hits"] == 2 and cache.stats()["guesses_used"] == 1


def test_a_guess_never_evicts_another_layers_experts(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    """Room for a guess is made only from its own layer's experts that nobody holds, requested or guessed,
    and that are not among the guess's `keep`; other layers' cached experts are their next hits."""
    path, data = store
    with SwapSpace(workdir, PAGE) as space, grouped(space, path, 2) as cache:
        use(cache, [0], data)
        use(cache, [3], data)  # full: a holds 0, b holds 3
        assert not cache.prefetch([4], keep=[3])  # only b's 3 could go, and keep protects it
        assert cache.cached() == [0, 3]
        assert cache.prefetch([4])  # b's own 3 makes room
        assert cache.cached() == [0, 4] and cache.stats()["evictions"] == 1
        assert not cache.prefetch([5])  # b holds only the unused guess 4; a's 0 is never taken
        assert cache.cached() == [0, 4]
        use(cache, [1], data)  # a layer's own read evicts a cached expert before an unused guess
        assert cache.cached() == [4, 1] and cache.stats()["guesses_wasted"] == 0
        use(cache, [1, 2], data)  # nothing else left: the unused guess goes, counted as wasted
        assert cache.cached() == [1, 2]
        s = cache.stats()
        assert (s["guesses_wasted"], s["wasted_bytes"], s["evictions"]) == (1, EXPERT, 3)


@pytest.mark.parametrize("how", ["prefetch", "read_ahead"])
def test_demanded_expert_overtakes_queued_guesses(store: tuple[Path, torch.Tensor], workdir: Path,
                                                  how: str) -> None:
    """Guessed reads (pre-gating's prefetch, the read-ahead) queue at prefetch priority: the expert a layer
    demands is read before them (checked by the order the read thread completes requests, never by
    timing)."""
    path, data = store
    with SwapSpace(workdir, PAGE) as space, grouped(space, path, 6) as cache:
        gate = threading.Event()
        hold = space.pool.acquire(PAGE)
        first = space.reads.submit(Ticket(hold.tensor, space._ext[str(path)], 0, str(path), False,
                                          lambda _t: gate.wait()))
        if how == "prefetch":
            assert cache.prefetch([3, 4, 5])
        else:
            cache.read_ahead([3, 4, 5])
            assert cache.read_order == [3, 4, 5] and cache.stats()["ahead_reads"] == 3
        cache.request([0])
        order: list[str] = []
        for k in (3, 4, 5, 0):
            for t in cache._entries[k].lease.tickets:
                t.on_done = lambda _t, name=f"e{k}": order.append(name)
        got: list[torch.Tensor] = []
        worker = threading.Thread(target=lambda: got.append(cache.acquire(0).view("e0").clone()))
        worker.start()
        demanded = threading.Event()
        while not demanded.wait(0.005):  # until the worker's demand reached the queue (no timing asserted)
            if cache._entries[0].lease.tickets[0].priority == DEMAND or not worker.is_alive():
                demanded.set()
        gate.set()
        worker.join()
        first.wait()
        hold.release()
        for k in (3, 4, 5):
            cache._entries[k].lease.wait()
        assert order == ["e0", "e3", "e4", "e5"], order
        assert torch.equal(got[0], data[:EXPERT])
        cache.release(0)


def take(cache: ExpertCache, key: int, data: torch.Tensor) -> None:
    """A layer's use of one requested expert: acquire, check its bytes, release."""
    lease = cache.acquire(key)
    assert torch.equal(lease.view(f"e{key}"), data[key * EXPERT:(key + 1) * EXPERT])
    cache.release(key)


def test_read_ahead_slides_behind_the_running_layer(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    """Room for three experts, a layer of three running: the next layer's experts are read ahead in order,
    each into the room of one the running layer has released; those the next layer is then routed to are
    used guesses (hits), the one it is not is a wasted guess; the pool never holds more than its room."""
    path, data = store
    with SwapSpace(workdir, PAGE) as space, grouped(space, path, 3) as cache:
        cache.request([0, 1, 2])
        cache.read_ahead([3, 4, 5])  # no room: every expert held is the running layer's, not yet used
        assert cache.read_order == [0, 1, 2]
        for key, read in ((0, 3), (1, 4), (2, 5)):
            take(cache, key, data)  # released: the next read ahead takes its room
            assert cache.read_order[-1] == read
        assert cache.cached() == [3, 4, 5] and cache.pool.peak_in_use <= 3 * EXPERT
        cache.request([3, 5])  # the next layer is routed to 3 and 5: 4 was read for nothing
        cache.read_ahead([])
        take(cache, 3, data)
        take(cache, 5, data)
        s = cache.stats()
        assert (s["guessed_reads"], s["ahead_reads"], s["guesses_used"], s["guesses_wasted"]) == (3, 3, 2, 1)
        assert (s["hits"], s["misses"], s["evictions"]) == (2, 3, 3)
        assert (s["bytes_read"], s["wasted_bytes"], s["needed_bytes"]) == (6 * EXPERT, EXPERT, 5 * EXPERT)
        assert cache.read_order == [0, 1, 2, 3, 4, 5]
        take(cache, 0, data)  # nothing is read ahead any more: 0 is read on demand
        assert cache.read_order == [0, 1, 2, 3, 4, 5, 0] and cache.stats()["guessed_reads"] == 3


def test_read_ahead_evicts_the_expert_needed_last(store: tuple[Path, torch.Tensor], workdir: Path) -> None:
    """Room for a read ahead comes from the expert nobody holds whose next use in the sequence is farthest
    after it (one outside the sequence first, the most recently used of those); never from an unused
    guess, a requested expert or one needed sooner."""
    path, data = store
    with SwapSpace(workdir, PAGE) as space, grouped(space, path, 3) as cache:
        use(cache, [0, 1], data)
        use(cache, [5], data)
        assert cache.cached() == [0, 1, 5]
        cache.read_ahead([3, 0])  # 1 and 5 are not in the sequence: 5, used last, goes; 0 is cached
        assert cache.cached() == [0, 1, 3] and cache.read_order[-1] == 3
        cache.read_ahead([3, 4, 0])  # now 1 goes
        assert cache.cached() == [0, 3, 4] and cache.read_order[-2:] == [3, 4]
        cache.read_ahead([0, 2])  # 2 could only take 0's room (needed before it) or a guess's: not read
        assert cache.cached() == [0, 3, 4] and cache.stats()["ahead_reads"] == 2
        cache.request([1, 2])  # a layer's own reads take what they need, an unused guess (3) last
        assert cache.read_order[-2:] == [1, 2] and cache.stats()["guesses_wasted"] == 1
        cache.read_ahead([5])  # no room: 4 is an unused guess, 1 and 2 are requested
        assert cache.read_order[-1] == 2
        take(cache, 1, data)  # released: its room goes to 5
        assert cache.read_order[-1] == 5 and cache.stats()["ahead_reads"] == 3
        take(cache, 2, data)
        assert cache.pool.peak_in_use <= 3 * EXPERT
        with pytest.raises(KeyError, match="no expert 9"):
            cache.read_ahead([9])


def test_read_ahead_waits_for_the_running_layers_reads(store: tuple[Path, torch.Tensor],
                                                       workdir: Path) -> None:
    """A layer needing more experts than fit: its reads not yet issued go before any read ahead, which
    takes each room its released experts leave once they are all issued."""
    path, data = store
    with SwapSpace(workdir, PAGE) as space, grouped(space, path, 2) as cache:
        cache.request([0, 1, 2])  # 2 waits for room
        cache.read_ahead([3, 4])
        assert cache.read_order == [0, 1]
        take(cache, 0, data)  # 0's room goes to the layer's own 2, not to 3
        assert cache.read_order == [0, 1, 2]
        take(cache, 1, data)
        take(cache, 2, data)
        assert cache.read_order == [0, 1, 2, 3, 4] and cache.cached() == [3, 4]
        assert cache.pool.peak_in_use <= 2 * EXPERT
        s = cache.stats()
        assert (s["misses"], s["ahead_reads"], s["guesses_used"], s["guesses_wasted"]) == (3, 2, 0, 0)


def test_views_at_one_stride_stack_without_a_copy() -> None:
    """What a fused experts module is handed when its experts lie one stride apart in the cache's pool:
    one 3-D view of the same bytes (equal to the stacked slices); any other layout is refused (None) and
    the caller copies."""
    from deepnvme.moe.grouped import stack_views

    pool = torch.arange(64 * 6, dtype=torch.float32)
    a, b, c = (pool[i * 64:i * 64 + 32].view(4, 8) for i in (0, 2, 4))  # 128 floats apart
    s = stack_views([a, b, c])
    assert s is not None and s.data_ptr() == a.data_ptr() and s.shape == (3, 4, 8)
    assert torch.equal(s, torch.stack([a, b, c]))
    one = stack_views([b])
    assert one is not None and one.data_ptr() == b.data_ptr() and torch.equal(one[0], b)
    assert stack_views([b, a]) is None  # descending addresses: no view keeps this order
    d = pool[5 * 64 + 16:5 * 64 + 48].view(4, 8)
    assert stack_views([a, b, d]) is None  # not one stride apart
    assert stack_views([a, pool[128:160].view(8, 4)]) is None  # another shape
    assert stack_views([a, None]) is None and stack_views([]) is None
