"""Models, optimizers and training loops shared by the optimizer tests (and their child processes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# name -> factory(params) for every optimizer and CPU variant the offloaded optimizer must match.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adagrad-foreach": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, foreach=True),
    "adagrad-fused": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, centered=True),
    "rmsprop-foreach": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5, foreach=True),
}
BASE = ["adam", "adamw", "sgd", "adagrad", "rmsprop"]


class PerParameter(torch.optim.Optimizer):
    """The shape of the tests' custom optimizers: `update(p, state, group)` for each parameter with a
    gradient, in order; the subclass says what it keeps."""

    def __init__(self, params: Any, lr: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, self.state[p], group)

    def update(self, p: torch.Tensor, st: dict, group: dict) -> None:
        raise NotImplementedError


def model(seed: int = 0, dtype: torch.dtype = torch.float32, width: int = 48) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 3)).to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, 16, generator=gen).to(dtype), torch.randn(8, 3, generator=gen).to(dtype)


def loss_of(m: nn.Module, step: int) -> torch.Tensor:
    dtype = next(m.parameters()).dtype
    x, y = batch(step, dtype)
    return (m(x) - y).float().pow(2).mean()


def rank_steps(net: nn.Module, opt: Any, rank: int, steps: range) -> list[float]:
    """One rank's training steps on its own batches (seeded by rank and step), returning the losses."""
    losses = []
    for s in steps:
        x, y = batch(100 * rank + s)
        opt.zero_grad()
        loss = (net(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: range, frozen_until: int = 0,
          masters: list[torch.Tensor] | None = None) -> list[float]:
    """Plain training; the first layer gets no gradient before `frozen_until` (its state starts late).

    With `masters` (the in-memory reference for master weights), `opt` steps fp32 masters and the model
    gets their rounded values.
    """
    losses = []
    params = list(m.parameters())
    for s in steps:
        opt.zero_grad()
        for p in params:
            p.grad = None
        loss = loss_of(m, s)
        loss.backward()
        if s < frozen_until:
            params[0].grad = params[1].grad = None
        if masters is not None:
            for p, w in zip(params, masters):
                w.grad = None if p.grad is None else p.grad.float()
        opt.step()
        if masters is not None:
            with torch.no_grad():
                for p, w in zip(params, masters):
                    p.copy_(w)
        losses.append(loss.item())
    return losses


def run(m: nn.Module, opt: torch.optim.Optimizer, steps: range,
        masters: list[torch.Tensor] | None = None) -> list[float]:
    """Training on seeded batches of `m`'s input width, on its device; with `masters`, `opt` steps them (the
    reference for master weights) and the model gets their rounded values."""
    first = next(m.parameters())
    width, dtype, device = first.shape[1], first.dtype, first.device
    losses = []
    for s in steps:
        gen = torch.Generator().manual_seed(s)
        x = torch.randn(8, width, generator=gen).to(device, dtype)
        m.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        loss = m(x).float().pow(2).mean()
        loss.backward()
        if masters is not None:
            for p, w in zip(m.parameters(), masters):
                w.grad = p.grad.float()
        opt.step()
        if masters is not None:
            with torch.no_grad():
                for p, w in zip(m.parameters(), masters):
                    p.copy_(w)
        losses.append(loss.item())
    return losses
