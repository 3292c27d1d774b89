"""stream_weights on a CUDA device: units copied from the locked pool on a side stream, same outputs as the
model kept on the device; moving a streamed model between CPU and GPU; unstream back to the device.

Plain torch models (no transformers: a device machine may not have it), stored with write_store.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from stream_helpers import hold_until_read_ahead  # noqa: E402

from deepnvme.offload import stats, stream_weights, unstream, write_store  # noqa: E402

# Three of the six blocks (260 KiB each in the pool): every forward reads every block, two ahead. A budget
# holding all six would keep them from one forward to the next and read each once (stats' cache_hits).
BUDGET = 1 << 20


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = 128, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Net, Path]:
    torch.manual_seed(0)
    net = Net().eval()
    return net, Path(write_store(net, tmp_path_factory.mktemp("net") / "store"))


def _ids() -> torch.Tensor:
    return torch.arange(48, device="cuda").reshape(4, 12) % 100


def test_streamed_on_cuda_equals_in_memory_on_cuda(stored: tuple[Net, Path]) -> None:
    net, store = stored
    ref = Net().cuda().eval()
    ref.load_state_dict(net.state_dict())
    with torch.inference_mode():
        want = ref(_ids())
    model = stream_weights(Net().cuda().eval(), store, BUDGET)
    assert model.blocks[0].up.weight.device.type == "cuda"
    side = torch.cuda.Stream()
    hold_until_read_ahead(model, model.blocks)  # each block waits for its read ahead: a hit whatever the load
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(_ids()), want)
        with torch.cuda.stream(side):  # the caller's own stream: copies are ordered before its compute
            got = model(_ids())
        side.synchronize()
        assert torch.equal(got, want)
    s = stats(model)
    assert s["unit_reads"] == 6 * 4 and s["cache_hits"] == 0, s
    assert (s["stalls"], s["hits"]) == (6, 6 * 3), s  # the recording forward reads on demand; then all ahead
    assert model._deepnvme_stream.copy_streams  # units went through the side stream
    unstream(model)
    assert all(p.device.type == "cuda" for p in model.parameters())
    with torch.inference_mode():
        assert torch.equal(model(_ids()), want)


def test_streamed_model_moved_between_cpu_and_cuda(stored: tuple[Net, Path]) -> None:
    net, store = stored
    with torch.inference_mode():
        want_cpu = net(_ids().cpu())
    model = stream_weights(Net().eval(), store, BUDGET)
    with torch.inference_mode():
        assert torch.equal(model(_ids().cpu()), want_cpu)
        model.cuda()
        assert model.blocks[2].down.weight.device.type == "cuda" and model.head.weight.is_cuda
        got = model(_ids())
        torch.testing.assert_close(got.cpu(), want_cpu)
        model.cpu()
        assert torch.equal(model(_ids().cpu()), want_cpu)
        model.cuda().half()  # units are converted after each read; the tensors outside units once
        got = model(_ids())
        assert got.dtype == torch.float16
        torch.testing.assert_close(got.float().cpu(), want_cpu, atol=5e-2, rtol=5e-2)


def test_load_safetensors_to_cuda(tmp_path: Path) -> None:
    from deepnvme.offload import load_safetensors

    st = pytest.importorskip("safetensors.torch", reason="safetensors is needed to write the checkpoint")
    torch.manual_seed(1)
    want = {"a": torch.randn(1000, 333), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(3).half()}
    st.save_file(want, tmp_path / "x.safetensors")
    got = load_safetensors(tmp_path / "x.safetensors", device="cuda", budget_bytes=256 << 10)
    assert all(got[k].is_cuda and torch.equal(got[k].cpu(), want[k]) for k in want)
