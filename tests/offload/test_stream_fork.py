"""fork() and a streamed model (infer's contract): the parent goes on as before; a forked child, by
os.fork or multiprocessing's "fork" start method, runs (or unstreams) the model through a swap space of its
own, even when a thread of the parent was inside a forward when it forked. Every child is a real process;
its exit is waited for with a deadline that only catches a hang. Each child first calls
torch.set_num_threads(1), as DataLoader workers do: torch's own CPU thread pool (OpenMP, MKL) does not
survive fork, and a child computing with it hangs whether or not the model is streamed."""

from __future__ import annotations

import multiprocessing
import threading
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

from deepnvme.offload import stats, stream_weights, unstream, write_store
from deepnvme.offload.model import Placeholder
from tests.offload.helpers import HANG, in_forked_child


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


BUDGET = 2 * (64 * 64 + 64) * 4 + (16 << 10)  # two blocks: reads run ahead and are in flight at the fork


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = model(x)
    return write_store(model, tmp_path_factory.mktemp("fork") / "store"), x, want


def _streamed(store: Path) -> Net:
    model = stream_weights(Net(), store, BUDGET, units="blocks")
    return model


def test_child_runs_the_model_and_the_parent_goes_on(net: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    store, x, want = net
    model = _streamed(store)
    with torch.no_grad():
        assert torch.equal(model(x), want)  # the read order is recorded; reads run ahead from here

    def child() -> None:
        with torch.no_grad():
            for _ in range(3):
                if not torch.equal(model(x), want):
                    raise AssertionError("the child computed something else")
        s = stats(model)
        if s["forwards"] != 4 or not s["order_recorded"]:
            raise AssertionError(f"stats in the child: {s}")
        unstream(model)  # reads through the child's own space too
        with torch.no_grad():
            if not torch.equal(model(x), want):
                raise AssertionError("the unstreamed model in the child computed something else")

    assert in_forked_child(child) == "ok"
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), want)
    assert stats(model)["forwards"] == 3
    unstream(model)


def _mp_child(model: Net, x: torch.Tensor, q: multiprocessing.Queue) -> None:
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            q.put(("ok", model(x).tolist()))  # values: a tensor would need the child alive to be received
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((traceback.format_exc(), None))


def test_multiprocessing_fork_child(net: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    store, x, want = net
    model = _streamed(store)
    with torch.no_grad():
        model(x)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_mp_child, args=(model, x, q))
    p.start()
    try:
        msg, got = q.get(timeout=HANG)
    finally:
        p.join(HANG)
        if p.is_alive():
            p.kill()
            p.join()
    assert msg == "ok" and torch.equal(torch.tensor(got), want), msg
    assert p.exitcode == 0
    with torch.no_grad():
        assert torch.equal(model(x), want)
    unstream(model)


def test_fork_while_a_thread_is_inside_a_forward(net: tuple[Path, torch.Tensor, torch.Tensor]) -> None:
    """The parent forks while another of its threads holds the model (inside block 2's forward): the child
    neither waits for that thread's lock nor sees its half-done forward."""
    store, x, want = net
    model = _streamed(store)
    with torch.no_grad():
        model(x)
    inside, go = threading.Event(), threading.Event()

    def hold(*_: object) -> None:
        if not go.is_set():
            inside.set()
            go.wait(HANG)

    model.blocks[2].register_forward_hook(hold)
    got: list[torch.Tensor] = []

    def run() -> None:
        with torch.no_grad():
            got.append(model(x))

    t = threading.Thread(target=run)
    t.start()
    try:
        assert inside.wait(HANG)

        def child() -> None:
            go.set()  # the child's copy of the event: its own forwards pass the hook
            if not isinstance(model.blocks[0].lin.weight, Placeholder):
                raise AssertionError("block 0 is not streamed in the child")
            with torch.no_grad():
                for _ in range(2):
                    if not torch.equal(model(x), want):
                        raise AssertionError("the child computed something else")

        assert in_forked_child(child) == "ok"
    finally:
        go.set()
        t.join(HANG)
    assert not t.is_alive() and torch.equal(got[0], want)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    unstream(model)


def test_streamed_experts_refuse_in_a_forked_child(tmp_path: Path) -> None:
    """A model whose experts are streamed raises RuntimeError in a forked child, saying what to do; the
    parent goes on."""
    pytest.importorskip("transformers", reason="transformers is needed for a Mixtral-style model")
    pytest.importorskip("accelerate", reason="accelerate is needed for streaming tests (the offload extra)")
    from tests.offload.test_stream_experts import BUDGET as EXPERT_BUDGET
    from tests.offload.test_stream_experts import mixtral

    ids = torch.tensor([[1, 5, 9, 2]])
    ref = mixtral("eager")
    with torch.no_grad():
        want = ref(ids).logits
    store = write_store(ref, tmp_path / "store")
    model = stream_weights(mixtral("eager", empty=True), store, EXPERT_BUDGET)

    def child() -> None:
        try:
            with torch.no_grad():
                model(ids)
        except RuntimeError as exc:
            if "experts were streamed by process" not in str(exc) or "spawn" not in str(exc):
                raise
        else:
            raise AssertionError("the child ran a model with streamed experts")

    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert in_forked_child(child) == "ok"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    unstream(model)
