"""stream_weights on plain torch modules (no Hugging Face): units the caller names, an execution order
that is not the module order, a unit run twice per forward, buffers, a state dict written as a store."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from deepnvme.offload import stats, stream_weights, unstream, write_store


class Mixer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.scale


class Backwards(nn.Module):
    """Runs its mixers last to first, and the middle one twice."""

    def __init__(self, width: int = 96) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.a, self.b, self.c = Mixer(width), Mixer(width), Mixer(width)
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for m in (self.c, self.b, self.a, self.b):
            x = m(x)
        return self.out(x)


def test_named_units_in_their_execution_order(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = Backwards().eval()
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = net(x)
    store = write_store(net.state_dict(), tmp_path / "store", units=["a", "b", "c"])
    model = Backwards()
    stream_weights(model, store, 96 * 96 * 4 * 2 + (8 << 10), units=[model.a, "b", model.c])
    # Each unit's compute is far too short for the next unit's read to land during it; a pause after each
    # run gives the read issued ahead time to finish, so that hits are counted without depending on timing.
    for m in (model.a, model.b, model.c):
        m.register_forward_hook(lambda *_: time.sleep(0.02))
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(x), want)
    s = stats(model)
    assert s["units"] == 3 and s["forwards"] == 4 and s["resyncs"] == 0, s
    assert s["unit_reads"] == 4 * 4 and s["hits"] + s["stalls"] == s["unit_reads"], s  # b: read per run
    assert s["hits"] > 0, s
    assert s["resident_bytes"] == sum(p.numel() * 4 for p in (*net.inp.parameters(), *net.out.parameters()))
    unstream(model)
    assert torch.equal(model.b.scale, net.b.scale) and torch.equal(model.a.lin.weight, net.a.lin.weight)
