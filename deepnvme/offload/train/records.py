"""What the optimizer knows of one parameter's swapped state, and how it lies in units of the swap space.

A parameter's swapped state is every tensor of its optimizer state with at least one dimension (moments,
sums, factored statistics, quantized codes, preconditioners: any shape and dtype, kept as they are) and,
with master weights, its fp32 master. 0-dim tensors (Adam's `step`) and other small values stay in memory.

The tensors lie in the swap file in one of two ways:

- whole: one unit holds every tensor, each at a page boundary; the parameter moves in one read and one
  write and is stepped in one call;
- in chunks, for a parameter whose state is larger than a tile, when the optimizer is element-wise,
  every tensor is shaped like the parameter and the arithmetic is in fp32 or wider: chunk k is elements
  [k·C, (k+1)·C) of every tensor, one unit per tensor per chunk (the units of a chunk back to back, so
  it moves in one request). Such a parameter is stepped a chunk at a time, so it may be larger than the
  budget. C is a multiple of CHUNK_ALIGN
  elements: every tensor's slice is whole pages.

Why not 16-bit arithmetic in chunks: torch splits an element-wise kernel over its threads at
ceil(numel / threads), and each thread's last elements go through the scalar loop; for bf16 and fp16 that
loop rounds differently from the vector one. Cut elsewhere (a chunk's own end), other elements take the
scalar loop, and the result differs from the same step in memory in a few elements. fp32 loops agree.
So a bf16 or fp16 parameter is stepped in chunks only with fp32 masters (the step's arithmetic is then
fp32), and state in a 16-bit dtype is never cut.
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from deepnvme.offload.swap import Lease, Unit, round_up

#: Elements per chunk are a multiple of this: 4096 elements of any dtype are whole pages.
CHUNK_ALIGN = 4096
#: Dtypes whose element-wise arithmetic is not the same in chunks as in one call (see the docstring).
REDUCED = frozenset({torch.bfloat16, torch.float16})


@dataclass(frozen=True)
class Entry:
    """One swapped tensor of a parameter's state: its key, dtype, shape, and its strides where they are not
    the contiguous ones (state made like a transposed parameter is laid out like it: torch's fused kernels
    walk the parameter's, the gradient's and the state's memory in step, and need the same strides)."""

    key: str
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def untouched(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over anonymous memory never touched: no memory is used until it is written. Stand-ins
    for tensors whose bytes a save reads from the drive; each has a storage of its own (told apart by its
    address), an empty one too."""
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=torch.uint8)[:n].view(dtype).view(shape)


def is_swapped(key: Any, value: Any) -> bool:
    """Whether a value of a parameter's state goes to the drive (a tensor of at least one dimension)."""
    return key != "step" and isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 0


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return any(_holds_tensor(v) for v in value)
    return False


def check_values(optimizer: str, name: str, state: Mapping[Any, Any]) -> None:
    """Refuse state the swap cannot carry exactly, naming it: tensors inside containers, sparse or
    quantized tensors (each would silently stay in memory, or lose its encoding)."""
    for k, v in state.items():
        why = None
        if isinstance(v, torch.Tensor):
            if v.layout != torch.strided:
                why = f"a {v.layout} tensor"
            elif v.is_quantized:
                why = f"a quantized tensor ({v.dtype})"
        elif _holds_tensor(v):
            why = f"a {type(v).__name__} holding tensors"
        if why is not None:
            raise TypeError(f"{optimizer}'s state {k!r} of {name} is {why}: OffloadedOptimizer swaps dense "
                            "tensors, one per key (keep this optimizer in memory, or keep that state as "
                            "plain tensors)")


def whole_bytes(entries: list[Entry]) -> int:
    """Bytes of the unit holding `entries` whole (each at a page boundary)."""
    return max(sum(round_up(e.nbytes) for e in entries), 1)


def chunk_elements(entries: list[Entry], tile_bytes: int) -> int:
    """Elements per chunk: as many as keep a chunk's units within `tile_bytes`, a multiple of CHUNK_ALIGN."""
    per_element = sum(e.dtype.itemsize for e in entries)
    return max(CHUNK_ALIGN, tile_bytes // per_element // CHUNK_ALIGN * CHUNK_ALIGN)


def can_chunk(entries: list[Entry], p: torch.Tensor) -> bool:
    """Whether `p`'s state may be cut into chunks: every tensor shaped like `p` and wider than 16 bits, `p`
    contiguous (whether the step itself is 16-bit is the caller's to say: see layout())."""
    return (bool(entries) and p.is_contiguous()
            and all(e.shape == p.shape and e.dtype not in REDUCED for e in entries))


@dataclass
class Record:
    """One parameter's swapped state: its tensors (`entries`), the units holding them, its small values.

    `chunk` is the elements per chunk (0: one unit holds the tensors whole); `units[k]` are chunk k's units
    (one per entry), or `[unit]` when whole. `made` is False while the units are reserved but the optimizer
    has not made the state yet (the first step of a parameter: its views are not handed over as state).
    """

    entries: list[Entry]
    shape: torch.Size
    dtype: torch.dtype
    units: list[list[Unit]]
    chunk: int = 0
    scalars: dict[str, Any] = field(default_factory=dict)
    made: bool = True

    @property
    def pieces(self) -> int:
        """How many calls step the parameter: its chunks, or one."""
        return len(self.units)

    @property
    def all_units(self) -> list[Unit]:
        return [u for units in self.units for u in units]

    @property
    def nbytes(self) -> int:
        """Bytes of the swap file the state takes."""
        return sum(u.io_nbytes for u in self.all_units)

    def span(self, k: int) -> tuple[int, int]:
        """The elements chunk k covers (all of them when whole)."""
        n = self.shape.numel()
        return (0, n) if not self.chunk else (k * self.chunk, min((k + 1) * self.chunk, n))

    def tensors(self, lease: Lease, k: int = 0) -> dict[str, torch.Tensor]:
        """Views of piece k's tensors in `lease`: whole tensors, or the chunk's 1-D slices."""
        if not self.chunk:
            raw = lease.view(self.units[0][0])
            out, at = {}, 0
            for e in self.entries:
                flat = raw[at:at + e.nbytes].view(e.dtype)
                out[e.key] = flat.view(e.shape) if e.stride is None else flat.as_strided(e.shape, e.stride)
                at += round_up(e.nbytes)
            return out
        lo, hi = self.span(k)
        return {e.key: lease.view(u)[:(hi - lo) * e.dtype.itemsize].view(e.dtype)
                for e, u in zip(self.entries, self.units[k])}

    def fits(self, k: int, state: Mapping[str, Any]) -> bool:
        """Whether `state` (as the optimizer left piece k) has exactly the swapped tensors laid out here."""
        lo, hi = self.span(k)
        swapped = {key: v for key, v in state.items() if is_swapped(key, v)}
        if set(swapped) != {e.key for e in self.entries}:
            return False
        for e in self.entries:
            v = swapped[e.key]
            shape_ok = v.shape == e.shape if not self.chunk else v.numel() == hi - lo
            if not shape_ok or v.dtype != e.dtype:
                return False
        return True


def layout(entries: list[Entry], p: torch.Tensor, tile_bytes: int,
           chunked: bool) -> tuple[int, list[list[int]]]:
    """(elements per chunk or 0, the bytes of each unit per piece) for `p`'s state `entries`: whole unless
    it is larger than a tile and `chunked` (an element-wise optimizer) allows cutting it."""
    whole = whole_bytes(entries)
    if not (chunked and whole > tile_bytes and can_chunk(entries, p)):
        return 0, [[whole]]
    c = chunk_elements(entries, tile_bytes)
    n = p.numel()
    return c, [[round_up(min(c, n - lo) * e.dtype.itemsize) for e in entries] for lo in range(0, n, c)]


def strides_of(t: torch.Tensor) -> tuple[int, ...] | None:
    """`t`'s strides when it is dense but not contiguous (a permutation of its dimensions), else None."""
    if t.is_contiguous():
        return None
    expected = 1  # dense: by growing stride, each is the product of the sizes before it
    for size, stride in sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda x: x[1]):
        if stride != expected:
            return None
        expected *= size
    return tuple(t.stride())


def least_piece(entries: list[Entry], p: torch.Tensor, chunked: bool) -> int:
    """The least pool memory `p`'s state can be stepped in: one chunk of CHUNK_ALIGN elements when it may
    be cut (whatever the tile then), else the whole unit."""
    whole = whole_bytes(entries)
    if not (chunked and can_chunk(entries, p)):
        return whole
    return min(whole, sum(round_up(min(CHUNK_ALIGN, p.numel()) * e.dtype.itemsize) for e in entries))


def entries_of(state: Mapping[str, Any], promote_from: torch.dtype | None = None) -> list[Entry]:
    """The entries of a state's swapped tensors, in its order. With `promote_from` (a 16-bit dtype), state
    taken over for an fp32 master in that dtype becomes fp32: Adagrad makes its sums at construction in the
    parameter's dtype, where the same optimizer over fp32 masters makes fp32 ones."""
    out = []
    for k, v in state.items():
        if is_swapped(k, v):
            dtype = (torch.float32 if promote_from is not None and v.is_floating_point()
                     and v.dtype == promote_from and promote_from != torch.float32 else v.dtype)
            out.append(Entry(k, dtype, v.shape, strides_of(v)))
    return out


def in_lease(t: torch.Tensor, lease: Lease | None) -> bool:
    """Whether `t`'s memory lies in `lease`'s pool buffer."""
    if lease is None or t.device.type != "cpu":
        return False
    start = lease.buffer.tensor.data_ptr()
    return start <= t.data_ptr() < start + lease.buffer.tensor.numel()
