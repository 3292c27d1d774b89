#!/usr/bin/env python3
"""One MoE layer, forward + backward: deepnvme (compiled routing op and pure-torch path) beside DeepSpeed's
MoE and a plain-PyTorch dense-mask layer, in one run with interleaved repeats.

    python3 bench/moe_bench.py [--tokens 4096,16384] [--experts 8,64] [--k 1,2] [--shapes SxExk,...]
                               [--expert scale|ffn] [--repeats 3] [--threads 1] [--out _bench_out/moe_bench]

Every contender runs in a worker process of its own, answering one JSON request per line on stdin/stdout:
deepnvme and the dense-mask layer in this interpreter, DeepSpeed in ``$DEEPNVME_DEEPSPEED_PYTHON`` or
``/work/dsvenv/bin/python`` (its own venv; skipped with the reason when it does not import). All layers get
the same input, the same gate weights and the same settings (hidden 1024, capacity factor 1.25, min capacity
4, drop on, DeepSpeed's defaults otherwise: RTS for k=1, sampled second expert for k=2).

Measured:
  * step time (forward, ``(out * g).sum() + 0.01 * l_aux``, backward): median wall seconds over the repeats,
    and the median process CPU seconds (less sensitive to other processes sharing the cores);
  * peak extra memory of the routing: a second worker per side, started with ``MALLOC_MMAP_THRESHOLD_`` fixed
    at 128 KiB so glibc maps every tensor-sized block on its own and unmaps it on free, which makes the
    resident set follow the live tensors; before a step the kernel's peak-RSS mark is reset
    (``/proc/self/clear_refs`` = 5) and ``VmHWM`` after the step minus ``VmRSS`` before it is the step's
    extra memory. These workers use an elementwise expert, so what they measure is the gate, the dispatch
    and combine buffers and what autograd keeps of them (torch has no CPU allocator statistics);
  * the all-to-all of one ``[E, C, M]`` buffer, forward and backward, at 2 processes over gloo: deepnvme's
    ``deepnvme.moe.comm.all_to_all`` and DeepSpeed's ``_AllToAll`` interleaved in one process group;
  * with ``--expert ffn``, the experts' matrix products alone ("products kept" / "products C", see
    PRODUCTS), which bound what any layer making the same BLAS calls can gain over DeepSpeed's.

``--expert scale`` (the default) gives every expert an elementwise scale, so the step is the routing (gate,
capacity, dispatch, combine and their backward); ``--expert ffn`` gives each a Linear-ReLU-Linear of width
``--ffn``, whose matrix products then dominate and are the same work in every contender. The dense-mask layer
builds ``S x E x C`` tensors (k * cf * S^2 elements) and runs only up to ``--dense-max-tokens``; being 30-100x
slower than the others, it is timed in the first round only and its memory taken for the routing alone, which
keeps the full run (8 shapes, 3 repeats, elementwise experts) to a few minutes.
Writes a markdown table to stdout and <out>.md, every sample to <out>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from _harness import MMAP_THRESHOLD, ROOT, PeakMemory, timed, wall  # first: puts this checkout on sys.path

HIDDEN = 1024
CAPACITY_FACTOR = 1.25
MIN_CAPACITY = 4
AUX_COEFF = 0.01
CONTENDERS = ("deepnvme op", "deepnvme torch", "deepnvme loop", "deepnvme dropless", "DeepSpeed",
              "DeepSpeed no-drop", "dense mask", "products kept", "products C")
# The experts' matrix products alone (--expert ffn), with nothing else of the layer: each Linear's forward
# (addmm), its input's and weight's gradients (mm) and its bias's (a column sum), on the rows deepnvme keeps
# (each expert its kept routes) or on DeepSpeed's padded blocks (C rows each), expert by expert in a
# layer's order. DeepSpeed's step over "products kept" estimates the most a layer making the same
# BLAS calls on the kept rows can gain over DeepSpeed's here (the "bound" column): an estimate, as the
# products alone leave the cache to them.
PRODUCTS = {"products kept": False, "products C": True}
# What each deepnvme contender changes: the routing implementation, the experts' computation
# (DEEPNVME_MOE_EXPERTS; unset = the library's choice), dropless routing.
DEEPNVME_SETTINGS = {
    "deepnvme op": {"impl": "op", "experts": "", "dropless": False},
    "deepnvme torch": {"impl": "torch", "experts": "", "dropless": False},
    "deepnvme loop": {"impl": "op", "experts": "loop", "dropless": False},
    "deepnvme dropless": {"impl": "op", "experts": "", "dropless": True},
}
# DeepSpeed's drop_tokens=False: every route kept, each expert padded to the largest one's count (C agreed
# over the group), which is the assignment dropless computes without the padding: the same outputs.
# Memory is measured with elementwise experts, which never run grouped: the loop contender would repeat op's.
MEMORY_CONTENDERS = ("deepnvme op", "deepnvme torch", "deepnvme dropless", "DeepSpeed", "dense mask")
SCOPES = {"routing": "routing alone (gate, dispatch, combine; the buffer goes from dispatch to combine)",
          "layer": "whole layer with elementwise experts"}


@dataclass(frozen=True)
class Config:
    """One layer shape: tokens S, experts E, choices k."""

    tokens: int
    experts: int
    k: int

    @property
    def capacity(self) -> int:
        """DeepSpeed's C = max(ceil(S / E * k * cf), min_capacity) (k=1 and k=2 alike)."""
        return max(math.ceil(self.tokens / self.experts * self.k * CAPACITY_FACTOR), MIN_CAPACITY)

    @property
    def label(self) -> str:
        return f"S={self.tokens} E={self.experts} k={self.k}"


# --------------------------------------------------------------------------------------------- layers
def deepspeed_python() -> str | None:
    """The interpreter DeepSpeed lives in, or None."""
    path = os.environ.get("DEEPNVME_DEEPSPEED_PYTHON") or "/work/dsvenv/bin/python"
    return path if Path(path).is_file() and os.access(path, os.X_OK) else None


def make_expert(kind: str, hidden: int, ffn: int) -> Any:
    """The expert every contender copies: an elementwise scale, or Linear-ReLU-Linear."""
    import torch
    from torch import nn

    if kind == "ffn":
        return nn.Sequential(nn.Linear(hidden, ffn), nn.ReLU(), nn.Linear(ffn, hidden))

    class Scale(nn.Module):
        """y = x * w: one parameter per feature, so the layer's cost is the routing around it."""

        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden))

        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.weight.fill_(1.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    return Scale()


def make_inputs(cfg: Config) -> tuple[Any, Any, Any]:
    """Input tokens, gate weight and output gradient, the same in every process (seeded CPU generator)."""
    import torch

    gen = torch.Generator().manual_seed(cfg.tokens * 131 + cfg.experts * 7 + cfg.k)
    x = torch.randn(cfg.tokens, HIDDEN, generator=gen)
    wg = torch.randn(cfg.experts, HIDDEN, generator=gen) * (HIDDEN ** -0.5)
    g = torch.randn(cfg.tokens, HIDDEN, generator=gen)
    return x, wg, g


class DenseMaskMoE:
    """DeepSpeed's pre-index-dispatch MoE in plain PyTorch: one-hot ``[S, E, C]`` combine weights and two
    einsums, with the same top-1 (RTS) / top-2 (sampled second expert) gating maths."""

    def __init__(self, cfg: Config, expert: Any) -> None:
        import copy

        import torch
        from torch import nn

        self.cfg = cfg
        self.wg = nn.Linear(HIDDEN, cfg.experts, bias=False)
        self.experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(cfg.experts)])
        self.modules = nn.ModuleList([self.wg, self.experts])
        self.torch = torch

    def parameters(self) -> Any:
        return self.modules.parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.modules.zero_grad(set_to_none=set_to_none)

    def _gate(self, x: Any) -> tuple[Any, Any]:
        torch, F = self.torch, self.torch.nn.functional
        e, cap, k = self.cfg.experts, self.cfg.capacity, self.cfg.k
        logits = F.linear(x.float(), self.wg.weight.float())
        gates = F.softmax(logits, dim=1)
        first = torch.argmax(gates, dim=1)
        mask1 = F.one_hot(first, e)
        l_aux = (gates.mean(0) * mask1.float().mean(0)).sum() * e
        if k == 1:
            rand = mask1 * torch.rand(mask1.shape)
            keep = torch.topk(rand, min(cap, x.shape[0]), dim=0).indices
            mask1 = mask1 * torch.zeros_like(mask1).scatter_(0, keep, 1)
            loc1 = torch.cumsum(mask1, 0) - 1
            w1 = (gates * mask1).sum(1)
            combine = (w1[:, None, None] * mask1[:, :, None]
                       * F.one_hot((loc1 * mask1).sum(1), cap)[:, None, :])
            return combine, l_aux
        noisy = logits - torch.log(-torch.log(torch.rand(logits.shape)))  # Gumbel-sampled second expert
        second = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1)
        mask2 = F.one_hot(second, e)
        loc1 = torch.cumsum(mask1, 0) - 1
        loc2 = torch.cumsum(mask2, 0) - 1 + mask1.sum(0, keepdim=True)
        mask1 = mask1 * (loc1 < cap)
        mask2 = mask2 * (loc2 < cap)
        g1, g2 = (gates * mask1).sum(1), (gates * mask2).sum(1)
        denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
        combine = ((g1 / denom)[:, None, None] * mask1[:, :, None]
                   * F.one_hot((loc1 * mask1).sum(1), cap)[:, None, :]
                   + (g2 / denom)[:, None, None] * mask2[:, :, None]
                   * F.one_hot((loc2 * mask2).sum(1), cap)[:, None, :])
        return combine, l_aux

    def __call__(self, x: Any) -> tuple[Any, Any, None]:
        torch = self.torch
        combine, l_aux = self._gate(x)
        dispatched = torch.einsum("sec,sm->ecm", combine.bool().type_as(x), x)
        out = torch.cat([ex(chunk) for ex, chunk in zip(self.experts, dispatched.chunk(self.cfg.experts))])
        return torch.einsum("sec,ecm->sm", combine.type_as(x), out), l_aux, None


def build_layer(family: str, cfg: Config, expert_kind: str, ffn: int, dropless: bool = False) -> Any:
    """The contender's layer with the shared gate weight copied in."""
    import torch

    x, wg, _ = make_inputs(cfg)
    expert = make_expert(expert_kind, HIDDEN, ffn)
    kwargs = {"num_experts": cfg.experts, "k": cfg.k, "capacity_factor": CAPACITY_FACTOR,
              "min_capacity": MIN_CAPACITY, "drop_tokens": True}
    if family == "dense":
        layer = DenseMaskMoE(cfg, expert)
        gate_weight = layer.wg.weight
    else:
        if family == "deepspeed":
            from deepspeed.moe.layer import MoE

            kwargs["drop_tokens"] = not dropless
        else:
            from deepnvme.moe import MoE

            kwargs["dropless"] = dropless
        layer = MoE(HIDDEN, expert, **kwargs).train()
        gate_weight = layer.deepspeed_moe.gate.wg.weight
    with torch.no_grad():
        gate_weight.copy_(wg)
    return layer


def routing_only(family: str, layer: Any) -> Any:
    """The layer's own gate, dispatch and combine with nothing between them (the buffer goes straight from
    dispatch to combine): what the routing alone allocates, whatever the experts are."""
    if family == "dense":
        def dense(x: Any) -> tuple[Any, Any, None]:
            import torch

            combine, l_aux = layer._gate(x)
            buf = torch.einsum("sec,sm->ecm", combine.bool().type_as(x), x)
            return torch.einsum("sec,ecm->sm", combine.type_as(x), buf), l_aux, None
        return dense
    moe = layer.deepspeed_moe
    if family == "deepspeed":
        from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode

        def deepspeed(x: Any) -> tuple[Any, Any, None]:
            l_aux, cap, e, idx, loc, gates, _ = moe.gate(x, None, True, False)
            slots = _route_slots(idx, loc, e, int(cap))
            buf = _sparse_encode(x, slots, e, int(cap))
            return _sparse_decode(buf.reshape(e * int(cap), -1), slots, gates, x.shape[0]), l_aux, None
        return deepspeed
    from deepnvme.moe.routing import combine, dispatch

    def deepnvme(x: Any) -> tuple[Any, Any, None]:
        r = moe.gate.route(x, None)
        buf = dispatch(x, r.expert_idx, r.slot, r.num_experts, r.capacity)
        return combine(buf, r.expert_idx, r.slot, r.weight), r.l_aux, None
    return deepnvme


def step(layer: Any, x: Any, g: Any, fn: Any = None) -> None:
    """One training step of the layer alone (or of ``fn``, its routing): forward, the loss with the aux
    term, backward."""
    layer.zero_grad(set_to_none=True)
    xx = x.detach().requires_grad_(True)
    out, l_aux, _ = (fn or layer)(xx)
    ((out * g).sum() + AUX_COEFF * l_aux).backward()
    # Both layers keep the step's l_aux (through its graph, the input leaf and its gradient) until the next
    # forward replaces it; drop that [S, M] gradient now, or it sits in the next step's baseline and is freed
    # inside the measured step, which shrinks both sides' extra memory by the same amount.
    xx.grad = None


def products(layer: Any, x: Any, padded: bool) -> Callable[[], None]:
    """The experts' matrix products of one step (see PRODUCTS) as a function to time: their rows are the
    counts the layer's gate keeps for ``x`` (``padded``: DeepSpeed's C rows per expert instead). Made in a
    layer's order, expert by expert: each Linear's forward takes the last one's output, then the backward
    runs the Linears in reverse, each input gradient the next one's output gradient."""
    import torch
    from torch import nn

    moe = layer.deepspeed_moe
    with torch.no_grad():
        r = moe.gate.route(x.detach())
    if padded:
        counts = [int(r.capacity)] * r.num_experts
    else:
        kept = r.expert_idx[r.slot >= 0].reshape(-1).long()
        counts = torch.bincount(kept, minlength=r.num_experts).tolist()
    gen = torch.Generator().manual_seed(0)
    work = []  # per expert: its rows' input, its output's gradient, its Linears' (weight, bias)
    for expert, n in zip(moe.experts.deepspeed_experts, counts):
        linears = [(m.weight.detach(), None if m.bias is None else m.bias.detach())
                   for m in expert.modules() if isinstance(m, nn.Linear)]
        if n and linears:
            h = torch.randn(n, linears[0][0].shape[1], generator=gen).to(x.dtype)
            g = torch.randn(n, linears[-1][0].shape[0], generator=gen).to(x.dtype)
            work.append((h, g, linears))

    def run() -> None:
        for h, g, linears in work:
            inputs = []
            for w, b in linears:
                inputs.append(h)
                h = torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())
            for (w, b), h in zip(reversed(linears), reversed(inputs)):
                torch.mm(g.t(), h)
                if b is not None:
                    g.sum(0)
                g = torch.mm(g, w)
    return run


# --------------------------------------------------------------------------------------------- worker side
def serve(family: str, threads: int) -> int:
    """Worker: build layers on request and answer ``time`` / ``memory`` requests, one JSON line each."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    try:
        import torch

        torch.set_num_threads(threads)
        if family == "deepspeed":
            import deepspeed

            version = deepspeed.__version__
        else:
            from deepnvme.moe import routing

            ok, why = routing.op_available()
            if not ok:
                print(f"# deepnvme moe op unavailable, its rows use the torch path: {why}", file=sys.stderr)
            version = "op" if ok else f"torch only ({why})"
    except Exception as exc:  # noqa: BLE001 - any import failure means this side is not compared
        print("UNAVAILABLE " + f"{type(exc).__name__}: {exc}".replace("\n", " "), file=proto)
        return 0
    print(f"READY {json.dumps({'version': version, 'torch': torch.__version__})}", file=proto)
    # The layers of the configuration being measured, kept across requests so that interleaved contenders
    # sharing this worker (deepnvme and the dense mask) are built and warmed once per configuration.
    layers: dict[tuple[Any, ...], Any] = {}
    warm: set[tuple[Any, ...]] = set()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            cfg = Config(**req["config"])
            dropless = bool(req.get("dropless"))
            dtype = getattr(torch, req.get("dtype", "float32"))
            key = (req["layer"], dropless, cfg, req["expert"], req["ffn"], dtype)
            if key not in layers:
                if any(k[2:] != key[2:] for k in layers):
                    layers.clear()
                    warm.clear()
                layer = build_layer(req["layer"], cfg, req["expert"], req["ffn"], dropless).to(dtype)
                layers[key] = (layer, tuple(t.to(dtype) for t in make_inputs(cfg)))
            if "impl" in req:
                os.environ["DEEPNVME_MOE_IMPL"] = req["impl"]
                os.environ["DEEPNVME_MOE_EXPERTS"] = req["experts"]
            layer, (x, _, g) = layers[key]
            if req["cmd"] == "time":
                path = (*key, req.get("impl"), req.get("experts"), req.get("padded"))
                fn = (partial(step, layer, x, g) if req.get("padded") is None
                      else products(layer, x, req["padded"]))
                if path not in warm:
                    fn()  # first touch of this layer and path: not timed
                    warm.add(path)
                samples = [list(timed(fn)) for _ in range(req["steps"])]
                print(json.dumps({"samples": samples}), file=proto)
            else:
                fn = routing_only(req["layer"], layer) if req["scope"] == "routing" else None
                step(layer, x, g, fn)  # warm: parameters' grads and lazily built state exist
                layer.zero_grad(set_to_none=True)
                with PeakMemory() as peak:
                    step(layer, x, g, fn)
                print(json.dumps({"extra_bytes": peak.extra}), file=proto)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which skips the case
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), file=proto)
    return 0


# --------------------------------------------------------------------------------------------- parent side
class Side:
    """Parent end of a worker process."""

    def __init__(self, python: str, family: str, threads: int, memory: bool) -> None:
        env = child_env()
        if memory:
            env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        self.family = family
        self.error: str | None = None
        self.info: dict[str, Any] = {}
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), "--serve", family,
                                      "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env=env)
        first = self.proc.stdout.readline().strip() if self.proc.stdout else ""
        if first.startswith("READY "):
            self.info = json.loads(first[len("READY "):])
        else:
            self.error = first[len("UNAVAILABLE "):] if first.startswith("UNAVAILABLE ") else (
                f"its process exited with {self.proc.wait()}")
            self.close()

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request, return its answer (``{"error": ...}`` when the worker is gone)."""
        if self.error or not (self.proc.stdin and self.proc.stdout):
            return {"error": self.error or "no worker"}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            answer = self.proc.stdout.readline()
        except OSError as exc:
            answer = ""
            self.error = f"its process is gone ({exc})"
        if not answer:
            self.error = self.error or f"its process exited with {self.proc.poll()}"
            return {"error": self.error}
        return json.loads(answer)

    def close(self) -> None:
        if self.proc.stdin:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def child_env() -> dict[str, str]:
    """This environment with this checkout first on PYTHONPATH (DeepSpeed's venv sees deepnvme too)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def request_for(contender: str, cfg: Config, args: argparse.Namespace, cmd: str,
                expert: str) -> dict[str, Any]:
    req: dict[str, Any] = {"cmd": cmd, "config": asdict(cfg), "expert": expert, "ffn": args.ffn,
                           "steps": args.steps, "dtype": args.dtype if cmd == "time" else "float32"}
    if contender.startswith("deepnvme"):
        req.update(layer="deepnvme", **DEEPNVME_SETTINGS[contender])
    elif contender in PRODUCTS:
        req.update(layer="deepnvme", padded=PRODUCTS[contender], **DEEPNVME_SETTINGS["deepnvme op"])
    else:
        req["layer"] = "deepspeed" if contender.startswith("DeepSpeed") else "dense"
        req["dropless"] = contender == "DeepSpeed no-drop"
    return req


def side_of(contender: str) -> str:
    return "deepspeed" if contender.startswith("DeepSpeed") else "local"


def dense_allowed(cfg: Config, args: argparse.Namespace) -> bool:
    return cfg.tokens <= args.dense_max_tokens


def measure(args: argparse.Namespace, configs: list[Config]) -> dict[str, Any]:
    """Step times (interleaved repeats) and routing memory of every contender at every configuration."""
    ds_python = None if args.no_deepspeed else deepspeed_python()
    notes: list[str] = []
    sides = {"local": Side(sys.executable, "local", args.threads, memory=False)}
    mem_sides = {"local": Side(sys.executable, "local", args.threads, memory=True)}
    if ds_python:
        sides["deepspeed"] = Side(ds_python, "deepspeed", args.threads, memory=False)
        mem_sides["deepspeed"] = Side(ds_python, "deepspeed", args.threads, memory=True)
    else:
        notes.append("DeepSpeed: no interpreter (set DEEPNVME_DEEPSPEED_PYTHON)" if not args.no_deepspeed
                     else "DeepSpeed: skipped (--no-deepspeed)")
    for name, side in {**sides, **{f"{k} (memory)": v for k, v in mem_sides.items()}}.items():
        if side.error:
            notes.append(f"{name} worker unavailable: {side.error}")
    versions = {name: side.info for name, side in sides.items()}
    times: dict[str, dict[str, list[list[float]]]] = {c.label: {} for c in configs}
    memory: dict[str, dict[str, dict[str, int]]] = {s: {c.label: {} for c in configs} for s in SCOPES}
    try:
        for rep in range(args.repeats):
            for cfg in configs:
                order = [c for c in args.contenders
                         if (c != "dense mask" or (dense_allowed(cfg, args) and rep == 0))
                         and (c not in PRODUCTS or args.expert == "ffn")]
                order = order[rep % len(order):] + order[:rep % len(order)]  # rotate who goes first
                for contender in order:
                    side = sides.get(side_of(contender))
                    if side is None or side.error:
                        continue
                    answer = side.ask(request_for(contender, cfg, args, "time", args.expert))
                    if "error" in answer:
                        notes.append(f"{contender} {cfg.label}: {answer['error']}")
                        continue
                    times[cfg.label].setdefault(contender, []).extend(answer["samples"])
                    print(f"# rep {rep} {cfg.label} {contender}: "
                          f"{[round(s[0], 3) for s in answer['samples']]} s", file=sys.stderr)
        for cfg in configs:
            for scope in SCOPES:
                for contender in (c for c in MEMORY_CONTENDERS if c in args.contenders):
                    side = mem_sides.get(side_of(contender))
                    if side is None or side.error or (contender == "dense mask" and (
                            scope != "routing" or not dense_allowed(cfg, args))) or (
                            contender == "deepnvme dropless" and scope == "routing"):
                        continue
                    req = request_for(contender, cfg, args, "memory", "scale")
                    answer = side.ask({**req, "scope": scope})
                    if "error" in answer:
                        notes.append(f"{contender} {cfg.label} {scope} memory: {answer['error']}")
                        continue
                    memory[scope][cfg.label][contender] = answer["extra_bytes"]
                    print(f"# memory {scope} {cfg.label} {contender}: "
                          f"{answer['extra_bytes'] / 2**20:.0f} MiB",
                          file=sys.stderr)
    finally:
        for side in (*sides.values(), *mem_sides.values()):
            side.close()
    return {"times": times, "memory": memory, "notes": notes, "versions": versions}


# --------------------------------------------------------------------------------------------- all-to-all
def _forward_backward_then_barrier(dist: Any, fn: Any, x: Any, g: Any) -> None:
    """One all-to-all forward and backward, timed up to the barrier so the figure covers both ranks."""
    fn(x).backward(g)
    dist.barrier()


def a2a_rank(rank: int, world: int, port: int, shapes: list[list[int]], repeats: int, out: str) -> None:
    """One rank of the 2-process all-to-all measurement (forward + backward of one [E, C, M] buffer)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    contenders: dict[str, Any] = {}
    try:
        import deepspeed
        from deepspeed.moe.sharded_moe import _AllToAll

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        contenders["DeepSpeed"] = lambda t: _AllToAll.apply(dist.group.WORLD, t)
    except ImportError:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    from deepnvme.moe.comm import all_to_all

    contenders["deepnvme"] = lambda t: all_to_all(t, dist.group.WORLD)
    results: dict[str, dict[str, list[float]]] = {}
    for shape in shapes:
        x = torch.randn(*shape, requires_grad=True)
        g = torch.randn(*shape)
        label = "x".join(map(str, shape))
        for rep in range(repeats + 1):
            for name, fn in (list(contenders.items()) if rep % 2 else list(contenders.items())[::-1]):
                dist.barrier()
                took = wall(partial(_forward_backward_then_barrier, dist, fn, x, g))
                if rep:  # the first round warms the connections up
                    results.setdefault(label, {}).setdefault(name, []).append(took)
                x.grad = None
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def a2a_main(args: argparse.Namespace) -> int:
    """``--a2a-child``: spawn the two ranks (in DeepSpeed's interpreter when there is one)."""
    import torch.multiprocessing as mp

    shapes = json.loads(args.a2a_shapes)
    mp.spawn(a2a_rank, args=(2, args.a2a_port, shapes, args.repeats, args.a2a_out), nprocs=2, join=True)
    return 0


def measure_a2a(args: argparse.Namespace, configs: list[Config]) -> tuple[dict[str, Any], str | None]:
    python = (None if args.no_deepspeed else deepspeed_python()) or sys.executable
    shapes = sorted({(c.experts, c.capacity, HIDDEN) for c in configs})
    out = Path(args.out).with_suffix(".a2a.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    env = child_env()
    proc = subprocess.run([python, str(Path(__file__).resolve()), "--a2a-child", "--a2a-shapes",
                           json.dumps([list(s) for s in shapes]), "--a2a-out", str(out), "--repeats",
                           str(args.repeats), "--a2a-port", str(29500 + os.getpid() % 1000)],
                          env=env, stdout=sys.stderr, timeout=900)
    if proc.returncode != 0 or not out.exists():
        return {}, f"all-to-all run failed with exit status {proc.returncode}"
    return json.loads(out.read_text()), None


# --------------------------------------------------------------------------------------------- report
def versus(contender: str) -> str:
    """The DeepSpeed layer a deepnvme contender is compared with: the no-drop one for dropless (the same
    assignment, there padded to the largest expert), the capacity one otherwise."""
    return "DeepSpeed no-drop" if contender == "deepnvme dropless" else "DeepSpeed"


def med(samples: list[list[float]], i: int) -> float:
    return statistics.median(s[i] for s in samples)


def render(args: argparse.Namespace, configs: list[Config], res: dict[str, Any], a2a: dict[str, Any],
           a2a_note: str | None) -> str:
    lines = [f"# MoE layer forward+backward ({args.expert} experts"
             + (f", ffn {args.ffn}" if args.expert == "ffn" else "") + f", {args.dtype}"
             + f", hidden {HIDDEN}, cf {CAPACITY_FACTOR}, {args.threads} thread(s) per process,"
             f" {args.repeats} interleaved repeats x {args.steps} step(s))",
             "", f"host: {platform.node()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
             f"versions: {json.dumps(res['versions'])}", "",
             "Step time: median wall s (median CPU s); ratio = DeepSpeed's wall time / this one's "
             "(>1: faster), dropless against DeepSpeed's drop_tokens=False (the same routes, padded to the "
             "largest expert). op = the library's defaults (routing op, experts that qualify computed "
             "together on their kept rows); loop = experts one by one on padded blocks. "
             "The dense mask is timed in the first round only, its memory for "
             "the routing alone. products kept / C: the experts' matrix products alone on the rows deepnvme "
             "keeps / on DeepSpeed's C rows per expert (ffn experts; see PRODUCTS in the script); the "
             "bound estimates the most a layer making the same BLAS calls on the kept rows could gain over "
             "DeepSpeed.",
             ""]
    shown = [c for c in CONTENDERS if c in args.contenders and (c not in PRODUCTS or args.expert == "ffn")]
    ours = [c for c in shown if c.startswith("deepnvme")]
    bound = "products kept" in shown and args.expert == "ffn"
    lines += ["| config | C | " + " | ".join(shown) + " | " + " | ".join(
        f"{'DS no-drop' if versus(c) != 'DeepSpeed' else 'DS'}/{c.split()[1]}" for c in ours)
              + (" | bound: DS/products kept" if bound else "") + " |",
              "|---|---|" + "---|" * (len(shown) + len(ours) + bound)]
    for cfg in configs:
        t = res["times"][cfg.label]
        cells = [f"{med(t[c], 0):.3f} ({med(t[c], 1):.3f})" if c in t else "—" for c in shown]
        ratios = [f"{med(t[versus(c)], 0) / med(t[c], 0):.2f}x" if c in t and versus(c) in t else "—"
                  for c in ours + (["products kept"] if bound else [])]
        lines.append(f"| {cfg.label} | {cfg.capacity} | " + " | ".join(cells + ratios) + " |")
    mem_shown = [c for c in MEMORY_CONTENDERS if c in args.contenders]
    mem_ours = [c for c in mem_shown if c.startswith("deepnvme")]
    for scope, what in SCOPES.items():
        lines += ["", f"Peak extra memory of one step, {what}: MiB; ratio = this one / DeepSpeed's.",
                  "", "| config | " + " | ".join(mem_shown) + " | "
                  + " | ".join(f"{c.split()[1]}/DS" for c in mem_ours) + " |",
                  "|---|" + "---|" * (len(mem_shown) + len(mem_ours))]
        for cfg in configs:
            m = res["memory"][scope][cfg.label]
            cells = [f"{m[c] / 2**20:.0f}" if c in m else "—" for c in mem_shown]
            ratios = [f"{m[c] / m['DeepSpeed']:.2f}" if c in m and m.get("DeepSpeed") else "—"
                      for c in mem_ours]
            lines.append(f"| {cfg.label} | " + " | ".join(cells + ratios) + " |")
    skipped = [c for c in configs if not dense_allowed(c, args)]
    if skipped:
        lines += ["", "dense mask skipped above --dense-max-tokens: " + "; ".join(
            f"{c.label} needs {c.tokens * c.experts * c.capacity * 5 / 2**30:.1f} GiB for one fp32 combine "
            f"tensor and its bool mask, and {2 * c.tokens * c.experts * c.capacity * HIDDEN / 1e9:.0f} GFLOP "
            "per forward einsum" for c in skipped)]
    lines += ["", "All-to-all of one [E, C, M] fp32 buffer, forward + backward, 2 processes (gloo): "
              "median ms", ""]
    if a2a:
        names = sorted({n for v in a2a.values() for n in v})
        lines += ["| buffer | MiB | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for label, by_name in a2a.items():
            mib = math.prod(int(d) for d in label.split("x")) * 4 / 2**20
            lines.append(f"| {label} | {mib:.0f} | "
                         + " | ".join(f"{statistics.median(by_name[n]) * 1e3:.1f}" if n in by_name else "—"
                                      for n in names) + " |")
    else:
        lines.append(a2a_note or "not measured (--no-a2a)")
    if res["notes"]:
        lines += ["", "Notes:"] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


def parse_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="4096,16384", help="comma-separated S values")
    p.add_argument("--experts", default="8,64", help="comma-separated E values")
    p.add_argument("--k", default="1,2", help="comma-separated k values (1 and/or 2)")
    p.add_argument("--shapes", help="comma-separated SxExk shapes (e.g. 16384x64x1,4096x8x1); replaces the "
                   "--tokens x --experts x --k grid")
    p.add_argument("--expert", choices=("scale", "ffn"), default="scale", help="expert module (see above)")
    p.add_argument("--ffn", type=int, default=1024, help="inner width of --expert ffn")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the layers and their inputs in the timed steps (memory: float32)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated subset of: {', '.join(CONTENDERS)}")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds over every case")
    p.add_argument("--steps", type=int, default=1, help="timed steps per case and round")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each worker")
    p.add_argument("--dense-max-tokens", type=int, default=4096, help="largest S for the dense-mask layer")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out")
    p.add_argument("--no-a2a", action="store_true", help="skip the 2-process all-to-all")
    p.add_argument("--out", default=str(ROOT / "_bench_out" / "moe_bench"), help="prefix for .json and .md")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--a2a-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--a2a-shapes", help=argparse.SUPPRESS)
    p.add_argument("--a2a-out", help=argparse.SUPPRESS)
    p.add_argument("--a2a-port", type=int, default=29511, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve(args.serve, args.threads)
    if args.a2a_child:
        return a2a_main(args)
    for name in ("repeats", "steps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name}: must be at least 1")
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown or not args.contenders:
        p.error(f"argument --contenders: unknown {unknown}; choose from {list(CONTENDERS)}")
    if args.shapes:
        try:
            configs = [Config(*(int(v) for v in shape.lower().split("x"))) for shape in args.shapes.split(",")
                       if shape.strip()]
        except (TypeError, ValueError):
            p.error(f"argument --shapes: expected SxExk[,SxExk...], got {args.shapes!r}")
        ks = [c.k for c in configs]
    else:
        ks = parse_list(args.k)
        configs = [Config(s, e, k) for s in parse_list(args.tokens) for e in parse_list(args.experts)
                   for k in ks]
    if not ks or any(k not in (1, 2) for k in ks):
        p.error("argument --k: values must be 1 or 2")
    if not configs or any(c.tokens < 1 or c.experts < 1 for c in configs):
        p.error("--tokens and --experts need positive values")
    t0 = time.time()
    res = measure(args, configs)
    a2a, a2a_note = ({}, None) if args.no_a2a else measure_a2a(args, configs)
    report = render(args, configs, res, a2a, a2a_note)
    given = " ".join(argv if argv is not None else sys.argv[1:])
    report += f"\ncommand: python3 bench/moe_bench.py {given} ({time.time() - t0:.0f} s)\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(report)
    record = {"args": vars(args), "configs": [asdict(c) for c in configs], **res, "a2a": a2a}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
