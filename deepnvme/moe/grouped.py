"""Grouped experts: a layer's local experts computed as one matrix multiply per linear step instead of one
module call per expert.

An expert qualifies when it is a ``nn.Linear`` or an ``nn.Sequential`` of ``nn.Linear`` layers and
element-wise activations (ReLU, GELU, SiLU, Tanh, Sigmoid, LeakyReLU, Identity, Dropout at p = 0 or in eval
mode), the same structure and shapes in every expert, with plain parameters of one dtype on one device. A
module of another class qualifies by declaring what its forward computes: ``grouped_steps()`` returning its
``nn.Linear`` submodules and element-wise functions (module-level ones, e.g. ``F.gelu``, so that every copy
names the same object) in order, e.g. ``return [self.fc1, F.gelu, self.fc2]``.
Anything else (PR-MoE's differently shaped experts, custom modules, hooks inside an expert, a streamer's
forwards, dropout in training) runs through the per-expert loop, which stays the reference.

How the multiply is done (``IMPLS``) is chosen per device type and dtype (``choose``: torch's grouped mm on
CUDA where a tiny forward and backward runs, ``segments`` elsewhere), or forced with
``DEEPNVME_MOE_EXPERTS``:

* ``segments``: each expert's rows through the BLAS products its own ``nn.Linear`` would make, written into
  one output, forward and backward in one autograd node, activations applied as the expert's own call
  would: the loop's bits on the same rows (see _SegmentLinear), nothing padded.
* ``grouped_mm``: torch's grouped matrix multiply over each expert's own rows, groups of any size, nothing
  padded. The bias is added after the product, so results may differ from the loop's fused ``addmm`` in the
  last bit (fp32: ~1e-7 relative; bf16: one rounding).
* ``bmm``: one batched multiply (``baddbmm``) over rows padded to the largest group, at the cost of the
  padded rows; usually the loop's bits (torch takes other kernels for tiny or odd-width matrices).
* ``loop``: each expert module called on its rows.

The experts' parameters are packed at construction (:func:`pack`): every expert's tensor of one name is a
slice of one ``[E, ...]`` storage, so the stacked weights ``grouped_mm`` and ``bmm`` multiply are a view,
not a copy (``segments`` takes each expert's tensors as they are). Saving
one expert's tensors alone with ``torch.save`` would therefore write the whole pack; ``state_dict()`` of the
model (its storage is written once) and deepnvme's MoE checkpoints (each expert's tensors are cloned) are
unaffected.

Threads: a plan (:class:`GroupedExperts`) changes nothing of its own once made, so threads running the same
layer share it; a re-pack inside one thread's forward re-points the parameters' ``.data`` at equal values,
and a forward already running in another thread keeps the memory it took.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

IMPL_ENV = "DEEPNVME_MOE_EXPERTS"
IMPLS = {
    "segments": "one matrix multiply per expert's rows, all in one autograd node (nothing padded)",
    "grouped_mm": "torch's grouped matrix multiply over each expert's rows (nothing padded)",
    "bmm": "one batched matrix multiply over rows padded to the largest expert's",
    "loop": "one call of each expert module (any expert)",
}

# Element-wise activation modules computed on all experts' rows at once, with the call their forward makes.
_ACTIVATIONS: dict[type, Callable[[nn.Module, Tensor], Tensor]] = {
    nn.ReLU: lambda m, x: F.relu(x),
    nn.GELU: lambda m, x: F.gelu(x, approximate=m.approximate),
    nn.SiLU: lambda m, x: F.silu(x),
    nn.Tanh: lambda m, x: torch.tanh(x),
    nn.Sigmoid: lambda m, x: torch.sigmoid(x),
    nn.LeakyReLU: lambda m, x: F.leaky_relu(x, m.negative_slope),
    nn.Identity: lambda m, x: x,
    nn.Dropout: lambda m, x: x,  # only while it is a no-op (p = 0 or eval): see GroupedExperts.ready
}
# Those whose result for an element does not depend on where it lies in the tensor (comparisons and one
# multiplication). The others (exp-, erf- or tanh-based) take a vector path for most elements and a scalar
# one at the end of a CPU tensor, whose last bits differ: they are applied expert by expert, on the same
# rows as each expert's own call, so that the results are the loop's bits.
_ANYWHERE = (nn.ReLU, nn.LeakyReLU, nn.Identity, nn.Dropout)


def _grouped_mm() -> Callable[..., Tensor] | None:
    """torch's grouped matrix multiply: the public name (torch 2.10 on), else the private one (2.9)."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether torch's grouped mm runs forward and backward here, on a tiny case with an empty group; the
    reason when not."""
    fn = _grouped_mm()
    if fn is None:
        return False, f"torch {torch.__version__} has no grouped mm"
    try:
        with torch.inference_mode(False), torch.enable_grad():  # the first forward may be an eval's
            return _try_grouped_mm(fn, device_type, dtype)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the fallback on this device and dtype
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _try_grouped_mm(fn: Callable[..., Tensor], device_type: str, dtype: torch.dtype) -> tuple[bool, str]:
    """A tiny forward and backward with an empty group."""
    x = torch.ones(3, 8, dtype=dtype, device=device_type, requires_grad=True)
    w = torch.ones(2, 8, 8, dtype=dtype, device=device_type, requires_grad=True)
    offs = torch.tensor([2, 2], dtype=torch.int32, device=device_type)
    y = fn(x[:2], w, offs=offs)
    y.backward(torch.ones_like(y))
    return True, ""


def choose(device: torch.device, dtype: torch.dtype) -> str:
    """How experts are multiplied on ``device`` in ``dtype``: ``$DEEPNVME_MOE_EXPERTS`` when set; else on
    CUDA torch's grouped mm where it works there (one kernel for all experts), and ``segments`` otherwise:
    on the CPU torch's grouped mm is itself a loop over the groups, and measured slower forward + backward
    than the BLAS products ``segments`` calls (bench/grouped_mm_bench.py: 64 groups of 150-320 rows,
    1024x1024, fp32, one core, torch 2.13: 68.7 against 75.7 GFLOP/s)."""
    forced = os.environ.get(IMPL_ENV, "").strip()
    if forced:
        if forced not in IMPLS:
            raise ValueError(f"{IMPL_ENV}={forced!r}: expected one of {sorted(IMPLS)}")
        return forced
    if device.type == "cuda" and _grouped_mm_works(device.type, dtype)[0]:
        return "grouped_mm"
    return "segments"


def describe() -> str:
    """One line for the report: the choice per device and dtype on this machine, and whether torch's
    grouped mm runs here."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    parts = []
    for dev in devices:
        picks = [f"{str(dtype).replace('torch.', '')} {choose(torch.device(dev), dtype)}"
                 for dtype in (torch.float32, torch.bfloat16, torch.float16)]
        works = _grouped_mm_works(dev, torch.bfloat16)
        picks.append("torch grouped mm " + ("runs" if works[0] else f"unavailable: {works[1]}"))
        parts.append(f"{dev}: " + ", ".join(picks))
    forced = os.environ.get(IMPL_ENV, "").strip()
    return "; ".join(parts) + (f" (forced by {IMPL_ENV})" if forced else "")


# ------------------------------------------------------------------------------------------------ packing
def pack(experts: Sequence[nn.Module]) -> bool:
    """Point every expert's parameter of one name at a slice of one new ``[E, ...]`` tensor (values kept,
    Parameter objects kept: ``.data`` is re-pointed), so :class:`GroupedExperts` stacks them without a
    copy. Returns False (nothing changed) when the experts' parameters differ in names, shapes, dtypes or
    devices, or are not plain tensors."""
    if len(experts) < 2:
        return False
    named = [dict(e.named_parameters()) for e in experts]
    first = named[0]
    for params in named[1:]:
        if params.keys() != first.keys():
            return False
        for name, p in params.items():
            q = first[name]
            if p.shape != q.shape or p.dtype != q.dtype or p.device != q.device:
                return False
    if any(type(p) is not nn.Parameter or type(p.data) is not torch.Tensor or p.device.type == "meta"
           for params in named for p in params.values()):
        return False
    # Normal tensors even when the forward that re-packs runs under inference_mode (an inference tensor
    # as a parameter's data would refuse training afterwards).
    with torch.inference_mode(False), torch.no_grad():
        for name in first:
            stacked = torch.stack([params[name].detach() for params in named])
            for i, params in enumerate(named):
                params[name].data = stacked[i]
    return True


def is_packed(experts: Sequence[nn.Module]) -> bool:
    """Whether every parameter name's tensors of ``experts`` lie as :func:`pack` leaves them."""
    named = [dict(e.named_parameters()) for e in experts]
    if len(named) < 2 or any(n.keys() != named[0].keys() for n in named):
        return False
    return all(stack_views([n[name].detach() for n in named]) is not None for name in named[0])


def stack_views(views: Sequence[Tensor | None]) -> Tensor | None:
    """One tensor with dim 0 over ``views`` (same shape, dtype and strides, at increasing addresses one
    stride apart within the first one's storage) without copying, or None when they do not lie so."""
    tensors = [v for v in views if v is not None]
    if not tensors or len(tensors) != len(views):
        return None
    first = tensors[0]
    if len(tensors) == 1:
        return first.unsqueeze(0)
    size = first.element_size()
    start = first.data_ptr()
    step = tensors[1].data_ptr() - start
    if step <= 0 or step % size:
        return None
    for i, v in enumerate(tensors):
        if (v.data_ptr() != start + i * step or v.shape != first.shape or v.dtype != first.dtype
                or v.stride() != first.stride() or v.device != first.device):
            return None
    storage = first.untyped_storage()
    # The others' memory lies inside the first's storage (the view below could not reach past it), so
    # they are its slices: two live storages never share addresses.
    last_byte = start + (len(tensors) - 1) * step + _extent(first) * size
    if last_byte > storage.data_ptr() + storage.nbytes():
        return None
    return torch.as_strided(first, (len(tensors), *first.shape), (step // size, *first.stride()),
                            first.storage_offset())


def _extent(t: Tensor) -> int:
    """Elements from t's first to one past its last, in its storage."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0


class _Stacked(torch.autograd.Function):
    """The experts' tensors of one name as one ``[E, ...]`` view of their packed storage (``view``, made by
    stack_views); the gradient of the view goes back to each tensor as its slice."""

    @staticmethod
    def forward(ctx: Any, view: Tensor, *tensors: Tensor) -> Tensor:  # type: ignore[override]
        return view.view_as(view)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (None, *grad.unbind(0))


def _stack(tensors: list[Tensor]) -> Tensor:
    """``torch.stack(tensors)`` for autograd, without the copy when they lie packed."""
    view = stack_views([t.detach() for t in tensors])
    if view is None:
        return torch.stack(tensors)
    return _Stacked.apply(view, *tensors) if torch.is_grad_enabled() and any(
        t.requires_grad for t in tensors) else view


def _dense(grad: Tensor) -> Tensor:
    """A gradient hook for a grouped mm's output: torch's CPU grouped mm rejects an expanded (stride-0)
    gradient, as a ``sum()`` loss makes it."""
    return grad.contiguous()


# Where a BLAS operand starts decides the kernel's path through its first elements, and so the last bits of
# the products. The loop hands each expert's first Linear a slice of the rows buffer and its last Linear's
# backward a slice of the output's gradient, and everything else fresh (64-byte aligned) tensors; segments
# does the same: those two as slices, any other operand that starts elsewhere (rows of a width that is not
# a multiple of 64 bytes) copied to fresh memory, and a product meant for such a slice made in fresh memory
# and copied in. With the usual widths (multiples of 16 floats) nothing is copied.
_ALIGN = 64


def _fresh(t: Tensor) -> Tensor:
    """``t``, or a copy of it in fresh memory when it does not start on an _ALIGN boundary."""
    return t if t.data_ptr() % _ALIGN == 0 else t.clone()


def _into(out: Tensor, op: Callable[..., Tensor], *args: Tensor) -> None:
    """``op(*args, out=out)``, through fresh memory when ``out`` does not start on an _ALIGN boundary."""
    if out.data_ptr() % _ALIGN == 0:
        op(*args, out=out)
    else:
        out.copy_(op(*args))


class _SegmentLinear(torch.autograd.Function):
    """``F.linear`` of each expert's rows with its own weight and bias, the products written straight into
    one output (``addmm`` / ``mm`` with ``out=``): the same BLAS calls on operands placed alike, so the same
    bits, as each expert's Linear on its rows, without an autograd node per expert. The experts' tensors
    come one by one (no stacked copy, packed or not), and each gets a gradient of its own, as in the loop:
    one ``[E, out, in]`` gradient would be fresh memory the size of all the weights every backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, counts: list[int], first: bool, last: bool,  # type: ignore[override]
                has_bias: bool, *tensors: Tensor) -> Tensor:
        """``tensors``: every expert's weight, then (``has_bias``) every expert's bias. ``first``: x is the
        experts' input (its slices go to the products as they are); ``last``: this Linear's output is the
        experts' output (its gradient's slices likewise)."""
        e_count = len(counts)
        weights, biases = tensors[:e_count], (tensors[e_count:] if has_bias else None)
        out = x.new_empty((x.shape[0], weights[0].shape[0]))
        place = (lambda t: t) if first else _fresh
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = slice(start, start + n)
                if biases is None:
                    _into(out[rows], torch.mm, place(x[rows]), weights[e].t())
                else:
                    _into(out[rows], torch.addmm, biases[e], place(x[rows]), weights[e].t())
            start += n
        ctx.counts, ctx.first, ctx.last, ctx.has_bias = counts, first, last, has_bias
        ctx.save_for_backward(x, *weights)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        e_count = len(ctx.counts)
        grad = grad.contiguous()
        need = ctx.needs_input_grad
        gx = torch.empty_like(x) if need[0] else None
        gws: list[Tensor | None] = [None] * e_count
        gbs: list[Tensor | None] = [None] * (e_count if ctx.has_bias else 0)
        place_x = (lambda t: t) if ctx.first else _fresh
        place_g = (lambda t: t) if ctx.last else _fresh
        start = 0
        for e, n in enumerate(ctx.counts):
            want_w, want_b = need[5 + e], ctx.has_bias and need[5 + e_count + e]
            if n:
                rows = slice(start, start + n)
                g = place_g(grad[rows])
                if gx is not None:
                    _into(gx[rows], torch.mm, g, weights[e])
                if want_w:
                    gws[e] = torch.mm(g.t(), place_x(x[rows]))
                if want_b:
                    gbs[e] = g.sum(0)
            else:  # an expert without rows gets zeros, as in the loop
                gws[e] = torch.zeros_like(weights[e]) if want_w else None
                if want_b:
                    gbs[e] = grad.new_zeros(weights[e].shape[0])
            start += n
        return (gx, None, None, None, None, *gws, *gbs)


class _AddGroupBias(torch.autograd.Function):
    """``h[rows of expert e] += bias[e]`` in place, group by group: no ``[T, out]`` tensor of repeated
    biases is built. The bias gradient is each group's column sum."""

    @staticmethod
    def forward(ctx: Any, h: Tensor, bias: Tensor, counts: list[int]) -> Tensor:  # type: ignore[override]
        ctx.counts = counts
        start = 0
        for e, n in enumerate(counts):
            if n:
                h[start:start + n].add_(bias[e])
            start += n
        ctx.mark_dirty(h)
        return h

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        sums, start = [], 0
        width = grad.shape[1:]
        for n in ctx.counts:
            sums.append(grad[start:start + n].sum(0) if n else grad.new_zeros(width))
            start += n
        return grad, torch.stack(sums), None


# ---------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class _Step:
    """One step of every expert: a Linear (``linear``) or an activation (its module type and settings)."""

    kind: type
    settings: tuple


class _Function:
    """Step kind of an element-wise function named by an expert's ``grouped_steps``."""


def _chain(expert: nn.Module) -> list[Any] | None:
    """What the expert computes, in order: itself (a Linear), its children (a Sequential), or what its
    ``grouped_steps()`` declares; None for anything else."""
    if type(expert) is nn.Linear:
        return [expert]
    if type(expert) is nn.Sequential:
        return list(expert)
    declared = getattr(expert, "grouped_steps", None)
    if callable(declared):
        try:
            return list(declared())
        except Exception:  # noqa: BLE001 - a declaration that fails means: not grouped
            return None
    return None


def _settings(m: nn.Module) -> tuple:
    """What a step module computes with: a Linear's shapes and whether it has a bias (read from its
    tensors, which a user may replace), an activation's public attributes."""
    if type(m) is nn.Linear:
        w, b = m._parameters.get("weight"), m._parameters.get("bias")
        return (None if w is None else tuple(w.shape), None if b is None else tuple(b.shape))
    return tuple(sorted((k, v) for k, v in vars(m).items()
                        if not k.startswith("_") and k not in ("training", "inplace")))


def _steps(expert: nn.Module) -> list[tuple[_Step, Any]] | None:
    """The expert as steps, or None when it is not a chain of Linears and element-wise activations (a
    declared module must be the expert's own: a shared one would get every expert's gradient)."""
    chain = _chain(expert)
    if not chain:
        return None
    own = {id(m) for m in expert.modules()}
    out: list[tuple[_Step, Any]] = []
    for m in chain:
        if isinstance(m, nn.Module) and id(m) not in own:
            return None
        if type(m) is nn.Linear:
            settings = _settings(m)
            if settings[0] is None or (settings[1] is not None and settings[1] != settings[0][:1]):
                return None
            out.append((_Step(nn.Linear, settings), m))
        elif type(m) in _ACTIVATIONS:
            out.append((_Step(type(m), _settings(m)), m))
        elif callable(m) and not isinstance(m, nn.Module):
            out.append((_Step(_Function, (m,)), m))
        else:
            return None
    return out if any(s.kind is nn.Linear for s, _ in out) else None


class GroupedExperts:
    """A layer's local experts seen as one chain of steps, computed for all experts at once.

    Built by :meth:`of` from the expert modules (None when they do not qualify); :meth:`ready` says whether
    they can run grouped on given rows now; :meth:`run` computes rows grouped by expert (``counts[e]`` rows
    of expert e, in expert order), :meth:`run_padded` an ``[E, C, M]`` buffer.
    """

    def __init__(self, experts: list[nn.Module], steps: list[_Step], modules: list[list[nn.Module]]) -> None:
        self.experts = experts
        self.steps = steps
        self.modules = modules  # modules[i][e]: step i of expert e
        # Called when the experts' parameters no longer lie packed (a deepcopy, load_state_dict(assign=True)):
        # packs them again instead of stacking copies on every forward. None: copy.
        self.repack: Callable[[], bool] | None = None

    @classmethod
    def of(cls, experts: Sequence[nn.Module]) -> GroupedExperts | None:
        """The plan for ``experts``, or None when they are not one shared chain of supported steps."""
        experts = list(experts)
        if not experts:
            return None
        chains = [_steps(e) for e in experts]
        if any(c is None for c in chains):
            return None
        first = [s for s, _ in chains[0]]  # type: ignore[union-attr]
        if any([s for s, _ in c] != first for c in chains):  # type: ignore[union-attr]
            return None
        modules = [[c[i][1] for c in chains] for i in range(len(first))]  # type: ignore[index]
        return cls(experts, first, modules)

    def ready(self, x: Tensor, streamed: bool = False) -> bool:
        """Whether the grouped computation equals calling the modules on ``x``'s rows now: no hook or
        replaced forward anywhere in the experts, dropout inactive, no autocast, and parameters that are
        plain tensors of ``x``'s dtype on its device. ``streamed``: the experts' own forwards and their
        tensors are a weight streamer's (its forwards only bring the tensors in place; its placeholders
        stand for plain tensors of their dtype and device)."""
        from torch.nn.modules import module as nn_module

        if (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks):
            return False
        if torch.is_autocast_enabled(x.device.type):
            return False
        for step, mods in zip(self.steps, self.modules):
            if step.kind is _Function:
                continue
            for m in mods:
                if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                        or "forward" in m.__dict__ or _settings(m) != step.settings):
                    return False  # hooked, or changed in place since the plan was made: the loop
                if step.kind is nn.Dropout and m.training and m.p > 0:
                    return False
                for p in m._parameters.values():
                    # type(), not .data: a streamer's placeholder refuses to be read outside its forward
                    if p is not None and ((not streamed and type(p) not in (nn.Parameter, torch.Tensor))
                                          or p.dtype != x.dtype or p.device != x.device):
                        return False
        return not any((not streamed and "forward" in e.__dict__) or e._forward_hooks or e._forward_pre_hooks
                       or e._backward_hooks or e._backward_pre_hooks for e in self.experts)

    def _weights(self, i: int) -> tuple[Tensor, Tensor | None]:
        """Step i's stacked weight ``[E, out, in]`` and bias ``[E, out]`` (or None)."""
        mods = self.modules[i]
        if self.repack is not None and stack_views([m.weight.detach() for m in mods]) is None:
            self.repack()
        weight = _stack([m.weight for m in mods])
        bias = _stack([m.bias for m in mods]) if mods[0].bias is not None else None
        return weight, bias

    @staticmethod
    def key(experts: Sequence[nn.Module]) -> tuple:
        """What a plan depends on, cheap to compute on every forward: the expert modules and their
        children (a child replaced, an expert replaced: another key). What changes in place (an
        activation's setting, a Linear's tensors) is checked by :meth:`ready` instead."""
        return tuple((id(e), tuple(map(id, e._modules.values()))) for e in experts)

    def run(self, x: Tensor, counts: list[int], impl: str) -> Tensor:
        """Rows ``x`` ``[T, M]`` grouped by expert (``counts[e]`` rows of expert e, in order) through every
        expert's chain: ``[T, M_out]``. ``impl`` is ``segments``, ``grouped_mm`` or ``bmm`` (see
        :data:`IMPLS`)."""
        if impl not in IMPLS or impl == "loop":
            raise ValueError(f"impl: experts computed together by {impl!r}: expected one of "
                             f"{sorted(set(IMPLS) - {'loop'})}")
        if len(counts) != len(self.experts) or sum(counts) != x.shape[0]:
            raise ValueError(f"counts must give {len(self.experts)} group sizes summing to {x.shape[0]} "
                             f"rows, got {counts}")
        if impl == "bmm" or (impl == "grouped_mm" and not self._aligned(x)):
            return self._run_padded_rows(x, counts)
        if impl == "segments":
            h = x
            for i, step in enumerate(self.steps):
                if step.kind is nn.Linear:
                    mods = self.modules[i]
                    has_bias = mods[0].bias is not None
                    tensors = [m.weight for m in mods] + ([m.bias for m in mods] if has_bias else [])
                    h = _SegmentLinear.apply(h, counts, i == 0, i == len(self.steps) - 1, has_bias, *tensors)
                else:
                    h = self._activation(i, h, counts)
            return h
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        mm = _grouped_mm()
        h = x
        for i, step in enumerate(self.steps):
            if step.kind is nn.Linear:
                weight, bias = self._weights(i)
                h = mm(h, weight.transpose(-2, -1), offs=offs)  # type: ignore[misc]
                if bias is not None:
                    h = _AddGroupBias.apply(h, bias, counts)
                if h.requires_grad:
                    h.register_hook(_dense)  # reaches the product through the bias's identity backward
            else:
                h = self._activation(i, h, counts)
        return h

    def _activation(self, i: int, h: Tensor, counts: list[int] | None = None) -> Tensor:
        """Step i (element-wise): the module's call or the declared function, on all rows at once when the
        result cannot depend on a row's place (see _ANYWHERE), else on each expert's rows (``counts``; in
        ``[E, C, M]`` form each ``h[e]``) as each expert's own call would see them."""
        step = self.steps[i]
        fn = step.settings[0] if step.kind is _Function else functools.partial(
            _ACTIVATIONS[step.kind], self.modules[i][0])
        if step.kind in _ANYWHERE:
            return fn(h)
        if counts is None:
            return torch.stack([fn(p) for p in h.unbind(0)])
        return torch.cat([fn(p) for p in h.split(counts)])

    def run_padded(self, x: Tensor) -> Tensor:
        """``[E, C, M]`` (expert e's rows in ``x[e]``) through every expert's chain, one ``baddbmm`` per
        Linear (usually the bits of each expert's ``F.linear`` on its rows; see the module docstring)."""
        h = x
        for i, step in enumerate(self.steps):
            if step.kind is nn.Linear:
                weight, bias = self._weights(i)
                wt = weight.transpose(-2, -1)
                h = torch.bmm(h, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), h, wt)
            else:
                h = self._activation(i, h)
        return h

    def _run_padded_rows(self, x: Tensor, counts: list[int]) -> Tensor:
        """:meth:`run` through :meth:`run_padded`: rows scattered into ``[E, max(counts), M]`` and gathered
        back."""
        e, width = len(counts), max(counts, default=0)
        sizes = torch.tensor(counts, device=x.device)
        expert = torch.repeat_interleave(torch.arange(e, device=x.device), sizes, output_size=x.shape[0])
        starts = sizes.cumsum(0) - sizes
        pos = torch.arange(x.shape[0], device=x.device) - starts[expert]
        padded = x.new_zeros(e, width, x.shape[1]).index_put((expert, pos), x)
        return self.run_padded(padded)[expert, pos]

    def _aligned(self, x: Tensor) -> bool:
        """torch's grouped mm wants every row stride a multiple of 16 bytes: each Linear's widths too."""
        size = x.element_size()
        for step in self.steps:
            if step.kind is nn.Linear:
                (fan_out, fan_in), _ = step.settings
                if (fan_in * size) % 16 or (fan_out * size) % 16:
                    return False
        return x.data_ptr() % 16 == 0 and (x.stride(0) * size) % 16 == 0


__all__ = ["IMPLS", "IMPL_ENV", "GroupedExperts", "choose", "describe", "is_packed", "pack", "stack_views"]
