"""stream_weights on plain torch modules (no Hugging Face): units the caller names, an execution order
that is not the module order, a unit run twice per forward, buffers, a state dict written as a store."""

from __future__ import annotations

from pathlib import Path

import torch
from stream_helpers import hold_until_read_ahead
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
    # Each unit waits for the read issued ahead for it (a hook, not a timer): a hit whatever the load.
    hold_until_read_ahead(model, (model.a, model.b, model.c))
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(x), want)
    s = stats(model)
    assert s["units"] == 3 and s["forwards"] == 4 and s["resyncs"] == 0, s
    assert s["unit_reads"] == 4 * 4, s  # b: read per run
    assert (s["stalls"], s["hits"]) == (4, 3 * 4), s  # the recording forward reads on demand; then all ahead
    assert s["resident_bytes"] == sum(p.numel() * 4 for p in (*net.inp.parameters(), *net.out.parameters()))
    unstream(model)
    assert torch.equal(model.b.scale, net.b.scale) and torch.equal(model.a.lin.weight, net.a.lin.weight)
