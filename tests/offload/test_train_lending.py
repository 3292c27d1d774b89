"""A unit's parameters computed in the pool memory they were read into (no copy), and copied out of it
when the pool needs the room: the same values, the same training, bit for bit (issue 36)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from deepnvme.offload import OffloadedOptimizer
from deepnvme.offload.train import offload_parameters
from deepnvme.offload.train.held import LENDING
from tests.offload.train_models import build, loss, train, units_of

pytestmark = pytest.mark.skipif(not LENDING, reason="this torch cannot point a storage at other memory")


def _least_budget(workdir: Path) -> int:
    """The smallest budget offload_parameters takes for the sequential model (its refusal says it)."""
    m = build("sequential")
    with pytest.raises(ValueError, match=r"at least (\d+)") as err:
        offload_parameters(m, workdir, 4096, units=units_of("sequential", m))
    return int(re.search(r"at least (\d+)", str(err.value)).group(1))  # type: ignore[union-attr]


def test_a_unit_computes_in_the_pool_memory_it_was_read_into(workdir: Path) -> None:
    m, ref = build("sequential"), build("sequential")
    units = units_of("sequential", m)
    seen: list[bool] = []
    with offload_parameters(m, workdir, 4 << 20, units=units) as off:
        pool = off.space.pool.memory
        lo, hi = pool.data_ptr(), pool.data_ptr() + pool.numel()

        class Linears(TorchFunctionMode):  # where each weight F.linear computes with lies
            def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                if func is F.linear and args[1] is not m[6].weight:  # m[6]: not a unit, stays in memory
                    seen.append(lo <= args[1].data_ptr() < hi)
                return func(*args, **(kwargs or {}))

        for s in range(3):
            with Linears():
                got = loss("sequential", m, s, 0)
            want = loss("sequential", ref, s, 0)
            assert torch.equal(got, want)
            got.backward()
            want.backward()
        assert len(seen) == 3 * 3 and all(seen)  # three of the units are Linear
        assert off.stats()["lent"] >= 3 * len(units)


def _train_at_least_budget(workdir: Path, step_in_backward: bool) -> dict[str, int]:
    """Train the sequential model at the least budget (and an optimizer budget that keeps its tiles within
    it), in memory and offloaded: bit for bit the same; the offload's stats()."""
    budget = _least_budget(workdir)
    accumulate = 1 if step_in_backward else 2
    ref, m = build("sequential"), build("sequential")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    with offload_parameters(m, workdir, budget, units=units_of("sequential", m)) as off, \
            OffloadedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), workdir, 64 << 10,
                               step_in_backward=step_in_backward) as opt:
        want = train("sequential", ref, ref_opt, 4, accumulate=accumulate)
        got = train("sequential", m, opt, 4, accumulate=accumulate)
        assert all(torch.equal(a, b) for a, b in zip(want, got))
        stats = off.stats()
    for a, b in zip(ref.parameters(), m.parameters()):
        assert torch.equal(a, b)
    return stats


def test_lent_units_are_copied_out_when_the_pool_needs_the_room(workdir: Path) -> None:
    """At the least budget the pool cannot hold a lent unit beside the gradients written for it: the unit is
    copied out of the pool (kept), and training stays bit-identical to memory."""
    stats = _train_at_least_budget(workdir, step_in_backward=False)
    assert stats["lent"] > 0 and stats["kept"] > 0, stats


def test_stepped_in_backward_a_unit_is_written_from_where_it_was_read(workdir: Path) -> None:
    """Stepped in the backward, a lent unit's new values are written from the pool memory it computed in:
    nothing copied out, the least budget enough, the same training."""
    stats = _train_at_least_budget(workdir, step_in_backward=True)
    assert stats["lent"] > 0 and stats["kept"] == 0, stats


def test_an_evaluation_thread_beside_training_sees_the_right_values(workdir: Path) -> None:
    """A second thread running forwards while the first trains at a tight budget: lending stops (the first
    thread's units are never copied out of the pool under the other's computation), every output of the
    evaluation equals memory's, and so do the accumulated gradients."""
    dim = 256

    def make() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(4)])

    ref, m = make(), make()
    x = torch.randn(16, dim)
    with torch.no_grad():
        want = ref(x)
    batches = [torch.randn(8, dim, generator=torch.Generator().manual_seed(i)) for i in range(20)]
    for b in batches:
        ref(b).sum().backward()
    stop, wrong, runs = threading.Event(), [], [0]

    def evaluate() -> None:  # at least once, however the threads are scheduled
        while True:
            with torch.no_grad():
                wrong.append(not torch.equal(m(x), want))
            runs[0] += 1
            if stop.is_set():
                return

    least = 2 * (dim * dim * 4 + 4096)  # the budget it takes: a unit, parameters and gradients, in pages
    with offload_parameters(m, workdir, least, units=list(m)) as off:
        for b in batches[:2]:  # lent, by this thread alone
            m(b).sum().backward()
        assert off.stats()["lent"] > 0
        t = threading.Thread(target=evaluate)
        t.start()
        try:
            for b in batches[2:]:
                m(b).sum().backward()
        finally:
            stop.set()
            t.join()
        assert runs[0] > 0 and not any(wrong)
        assert not off.lender.on
    for a, b in zip(ref.parameters(), m.parameters()):
        assert torch.equal(a.grad, b.grad)
