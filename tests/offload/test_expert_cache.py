"""The expert cache on the real disk: only requested experts are read, least-recently-used eviction inside the
capacity, hit rate and bytes per token, a demanded expert ahead of queued prefetches (checked by the order the
read thread completes requests, never by timing), and failed reads never served from the cache."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from deepnvme.offload import SwapSpace
from deepnvme.offload._doors import PAGE
from deepnvme.offload.expert_cache import ExpertCache
from deepnvme.offload.queues import DEMAND, Ticket

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
