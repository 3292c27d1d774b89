"""stream_weights: run a model whose weights stay on the drive, each unit (a transformer block) read in just
before its forward and given back right after, through a budget of locked memory.

How: the tensors of each unit module are replaced by placeholders (tensors without storage that raise a
clear error when computed with); the unit's `forward` is wrapped so that its tensors are views of pool
memory while it runs and placeholders again after, whatever way it ends (an exception, Ctrl-C). The input
embedding table is read by rows (infer/rows.py) and the head is a unit when it does not fit in memory
(`embeddings`); tensors outside units (the final norm, position tables) are read from the store once into
tensors of their own, so a model built on the meta device runs from the store alone. A model loaded in
memory gives back its units' and experts' memory: nothing keeps the tensors the placeholders replace. The
first forward of the whole model records the order in which units run (a unit called on its own is not
recorded); from then on a cyclic ReadAhead keeps reads of the next units (wrapping into the next forward) in
flight as far as the budget allows, so the drive reads while the CPU or GPU computes. A unit run out of the
recorded order (an interrupted forward, a caller running one block) restarts the read ahead from it: never
wrong, only slower.

On CUDA (the model moved with `.to("cuda")`, before or after streaming), each unit's bytes are copied
from the locked pool to the device on a side stream; the compute stream waits on that copy only.

Decisions: threads running one streamed model are serialized (a lock held for each forward of the
model: the pool and the read order are the model's, not the thread's); a backward through streamed
weights raises (the views are marked modified when their memory goes back to the pool, so autograd
refuses instead of reading reused memory): streaming is for inference. Tensors whose dtype differs from
the store's (`model.half()` after streaming, a bf16 checkpoint for an fp32 model) are converted after each
read, within a kind only: a store tensor of another kind (integer, floating, bool, complex) than the
model's tensor is refused when streaming starts (store.check_kind).

fork(): the parent goes on as before. A forked child (os.fork, multiprocessing's "fork" start method) that
runs or unstreams the model makes its own swap space on its first forward (another `budget_bytes` of
locked memory, in the child) and reads from there, with the read order already recorded; the inherited
space, whose I/O threads stayed in the parent, is left alone. A model with streamed experts, or on CUDA,
raises RuntimeError in the child instead. Forking from inside a forward is not supported.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
from torch import nn

from deepnvme.offload._doors import PAGE
from deepnvme.offload.experts import ExpertStreamer, split_budget
from deepnvme.offload.infer.load import read_into
from deepnvme.offload.infer.rows import RowReads, row_table
from deepnvme.offload.infer.running import STREAM_ATTR, Streamer, UnitRun, streamer_of
from deepnvme.offload.model import Placeholder, Resident, Slot, match_store, table_units, unit_modules
from deepnvme.offload.stores import Store, TensorInfo, lease_bytes, open_store
from deepnvme.offload.swap import SwapSpace, budget_arg, memory_left


def stream_weights(model: nn.Module, store: Store | str | os.PathLike, budget_bytes: int, *,
                   units: Any = None, prefetch: bool = True, expert_lookahead: int = 0,
                   embeddings: bool | None = None) -> nn.Module:
    """Make `model` run with the weights of its units on the drive (see the module docstring).

    `store`: a Store (deepnvme.offload.stores) or the path of one (a safetensors file or checkpoint
    directory, sharded or not, or a directory written by write_store). `budget_bytes`: the locked memory
    units are read into; it must hold the largest unit, and what is left runs reads ahead. `units`: None
    for the model's repeated blocks, the name of a module whose children are the units, or a list of
    modules or module names. `embeddings`: whether the input embeddings and the output head (Hugging
    Face's `get_input_embeddings()` / `get_output_embeddings()`) are streamed rather than kept in memory:
    a plain input table not tied to the head is read by rows, only those each lookup names
    (deepnvme.offload.infer.rows); the head (and a tied or custom input table) is a unit, read whole just
    before it runs (tied ones from their one tensor in the store, by each in turn). True, False, or None
    (the default): an input table by rows from rows.ROWS_FROM bytes on, and the head (with a table tied to
    it) only when the budget and the tables would not fit in the memory the process has left (its memory
    cgroup's room, or MemAvailable if less), and only a head larger than the largest block (experts not
    counted) whose reads fit the budget beside the largest expert (deepnvme.offload.model.table_units,
    _match_units); otherwise it stays in memory, never an error.
    `prefetch=False` reads each unit only when it runs, and each expert only when routed to (by default
    the next layers' experts are read ahead when a layer's tokens are expected to use nearly all of its
    own: deepnvme.offload.experts.FULL_USE). `expert_lookahead`: for Mixture-of-Experts models
    whose routers are found (Hugging Face, Mixtral-style), how many layers ahead each MoE layer guesses
    the experts with their routers applied to its own input and reads them behind its own ("pre-gating";
    0, the default: experts are read only when routed to; `prefetch=False` implies 0). A guess never
    changes the output; what guesses read, used and wasted is in `stats(model)["experts"]`. Why off by
    default: a guess that is wrong costs a read, and the room it takes costs a cached expert's later
    hit; it pays where the next layer's routing is well predicted and read bandwidth is to spare
    (bench/stream_bench.py measures both). Returns `model`, changed in place.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    budget_bytes = budget_arg(budget_bytes)
    if isinstance(expert_lookahead, bool) or not isinstance(expert_lookahead, int) or expert_lookahead < 0:
        raise ValueError(f"expert_lookahead must be an int >= 0, got {expert_lookahead!r}")
    if getattr(model, STREAM_ATTR, None) is not None:
        raise RuntimeError("this model is streamed already: call deepnvme.offload.unstream(model) first")
    owns = not isinstance(store, Store)
    if owns:
        if not isinstance(store, (str, os.PathLike)):
            raise TypeError(f"store must be a Store or a path, got {type(store).__name__}")
        store = open_store(store)
    try:
        return _stream(model, store, owns, budget_bytes, units, prefetch, expert_lookahead if prefetch else 0,
                       embeddings)
    except BaseException:
        if owns:
            store.close()
        raise


def _warn_unused(store: Store, used: list[TensorInfo]) -> None:
    """Warn, naming a few, when store tensors fill nothing in the model: a checkpoint of a larger model
    (six blocks for a model of four) streams without an error, since checkpoints legitimately carry
    tensors a model ignores (a head the base model lacks, a saved attention mask). A tensor whose bytes a
    used one shares (tied weights listed under both names) is used; so is a fused expert tensor whose
    slices (named `<tensor>[<expert>]`, deepnvme.offload.experts) are."""
    tensors = store.tensors()
    names = {i.name if i.name in tensors else i.name.rsplit("[", 1)[0] for i in used}
    places = {(i.path, i.offset, i.nbytes) for i in used}
    unused = [n for n, i in tensors.items() if n not in names and (i.path, i.offset, i.nbytes) not in places]
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        warnings.warn(f"{len(unused)} tensors of the store {store.path} fill nothing in the model and are "
                      f"not read: {', '.join(repr(n) for n in unused[:5])}{more} (a store for a larger or "
                      "another model?)", UserWarning, stacklevel=4)


def _stream(model: nn.Module, store: Store, owns: bool, budget: int, units: Any, prefetch: bool,
            lookahead: int, embeddings: bool | None) -> nn.Module:
    """stream_weights once its arguments are checked and the store is open: match the model to the store,
    plan the units within the budget, read the residents, then put placeholders and wrappers in place."""
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()  # a model built with init_empty_weights has its tied parameters apart until tied
    # Experts are units of their own (deepnvme.offload.experts).
    experts = ExpertStreamer.for_model(model, store, lookahead, read_ahead=prefetch)
    chosen, slots, residents = _match_units(model, store, units, embeddings, budget, experts)
    table = row_table(model, residents, embeddings)
    if table is not None:
        residents.remove(table)
    used = [s.info for unit in slots for s in unit] + [r.info for r in residents]
    if table is not None:
        used.append(table.info)
    if experts is not None:
        used += [p.info for x in experts.experts.values() for p in x.parts]
    _warn_unused(store, used)
    plan = _plan_units(store, chosen, slots, budget)
    expert_bytes = 0
    if experts is not None:
        budget, expert_bytes = split_budget(budget, [lease_bytes(u.blobs) for u in plan],
                                            experts.largest)
    space = SwapSpace(None, budget)
    streamer: Streamer | None = None
    try:
        resident_bytes = _read_residents(space, store, residents)
        for u in plan:
            u.units = [space.add_external(f"{u.name}#{j}", b.path, b.offset, b.nbytes)
                       for j, b in enumerate(u.blobs)]
        streamer = Streamer(store, owns, space, plan, prefetch, resident_bytes)
        if table is not None:
            names = {id(m): n for n, m in model.named_modules()}
            streamer.rows = RowReads(store, table, names[id(table.places[0][0])])
            streamer.rows.prepare()
        if experts is not None:
            experts.install(space, expert_bytes)
            streamer.experts = experts
    except BaseException:
        if streamer is not None and streamer.rows is not None:
            streamer.rows.close()
        space.close()
        raise
    if streamer.rows is not None:
        streamer.rows.install(streamer)
    for i, u in enumerate(plan):
        for s in u.slots:
            s.placeholder = Placeholder(f"{u.name}.{_rel(u, s)}", u.name, s.info.shape, s.dtype,
                                        s.device)
            s.put(s.placeholder)
        _wrap_unit(streamer, i, u)
    _wrap_root(streamer, model)
    setattr(model, STREAM_ATTR, streamer)
    return model


def _match_units(model: nn.Module, store: Store, units: Any, embeddings: bool | None, budget: int,
                 experts: ExpertStreamer | None, room: int | None = None
                 ) -> tuple[list[tuple[str, nn.Module]], list[list[Slot]], list[Resident]]:
    """The units (blocks, and the tables table_units adds) matched to the store: (units, their slots, the
    residents). A table the auto rule chose whose reads would not fit the budget's whole pages beside the
    largest expert stays in memory instead, with the tables tied to it: auto never makes a call fail.
    `room`: the memory the process has left (default: memory_left())."""
    skip = experts.owned if experts is not None else frozenset()
    blocks = unit_modules(model, units)
    tables = table_units(model, blocks, embeddings, budget, memory_left() if room is None else room, skip)
    slots, residents = match_store(model, store.path, store.tensors(), blocks + tables, skip)
    if tables and embeddings is None:
        room = budget // PAGE * PAGE - (experts.largest if experts is not None else 0)
        for unit in slots[len(blocks):]:
            names = list(dict.fromkeys(s.info.name for s in unit))
            if lease_bytes(store.blobs(names)) > room:
                tables = []
                slots, residents = match_store(model, store.path, store.tensors(), blocks, skip)
                break
    return blocks + tables, slots, residents


def _plan_units(store: Store, chosen: list[tuple[str, nn.Module]], slots: list[list[Slot]],
                budget: int) -> list[UnitRun]:
    """Each unit with the blobs its tensors are read in; ValueError naming the first unit whose reads do not
    fit the budget's whole pages."""
    plan = []
    for k, (name, mod) in enumerate(chosen):
        names = list(dict.fromkeys(s.info.name for s in slots[k]))
        blobs = store.blobs(names) if names else []
        need = lease_bytes(blobs)
        if need > budget // PAGE * PAGE:
            raise ValueError(f"unit {name!r} takes {need} bytes of locked memory, over "
                             f"budget_bytes={budget}: raise budget_bytes to at least {need} (more lets "
                             "reads run ahead)")
        plan.append(UnitRun(name, mod, slots[k], blobs))
    return plan


def _read_residents(space: SwapSpace, store: Store, residents: list[Resident]) -> int:
    """Read the tensors outside units into memory of their own (through `space`'s pool), in the model's
    dtype, and put them in place of the model's (meta or not); their bytes in memory."""
    dests = {}
    for r in residents:
        device = torch.device("cpu") if r.tensor.is_meta else r.tensor.device
        dests[r.info.name] = torch.empty(r.info.shape, dtype=r.info.dtype, device=device)
    read_into(space, store, dests)
    resident_bytes = 0
    for r in residents:
        t, new = r.tensor, dests[r.info.name]
        if new.dtype != t.dtype:
            new = new.to(t.dtype)
        resident_bytes += new.numel() * new.element_size()
        value = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        for mod, attr, p in r.places:
            (mod._parameters if p else mod._buffers)[attr] = value
    return resident_bytes


def _rel(u: UnitRun, s: Slot) -> str:
    for n, m in u.module.named_modules():
        if m is s.module:
            return f"{n}.{s.attr}" if n else s.attr
    return s.attr


def _wrap_unit(streamer: Streamer, i: int, u: UnitRun) -> None:
    mod = u.module
    u.had_forward = "forward" in mod.__dict__
    u.orig_forward = mod.forward

    @functools.wraps(u.orig_forward)  # the signature stays visible (generate() inspects it)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with streamer.lock:
            streamer.adopt()
            streamer.enter(i)
            try:
                return u.orig_forward(*args, **kwargs)
            finally:
                streamer.leave(i)

    mod.forward = forward
    u.orig_apply = mod.__dict__.get("_apply")

    def _apply(fn: Any, recurse: bool = True) -> nn.Module:
        with streamer.lock:
            for s in u.slots:
                probe = fn(torch.empty(0, dtype=s.dtype, device=s.device))
                s.dtype, s.device = probe.dtype, probe.device
            for s in u.slots:
                s.put(None)
            try:
                type(mod)._apply(mod, fn, recurse)
            finally:
                for s in u.slots:
                    s.placeholder = Placeholder(s.placeholder._name, u.name, s.info.shape, s.dtype, s.device)
                    s.put(s.placeholder)
        return mod

    mod._apply = _apply  # type: ignore[method-assign]


def _wrap_root(streamer: Streamer, model: nn.Module) -> None:
    streamer.root_had_forward = "forward" in model.__dict__
    streamer.root_forward = model.forward

    @functools.wraps(streamer.root_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with streamer.lock:
            streamer.adopt()
            ok = False
            streamer.root_depth += 1
            try:
                out = streamer.root_forward(*args, **kwargs)
                ok = True
                return out
            finally:
                streamer.root_depth -= 1
                streamer.end_forward(ok)

    model.forward = forward


def unstream(model: nn.Module) -> nn.Module:
    """Undo stream_weights: every streamed tensor is read back into memory (on the device and in the dtype
    its placeholder had), the forwards are the model's own again, the pool and files are released."""
    st = streamer_of(model)
    with st.lock:
        st.adopt()
        if st.reader is not None:
            st.reader.close()
        dests: dict[str, torch.Tensor] = {}
        for u in st.units:
            for s in u.slots:
                if s.info.name not in dests:
                    dests[s.info.name] = torch.empty(s.info.shape, dtype=s.info.dtype, device=s.device)
        if st.rows is not None:
            dests[st.rows.info.name] = torch.empty(st.rows.info.shape, dtype=st.rows.info.dtype)
        read_into(st.space, st.store, dests)
        if st.rows is not None:
            st.rows.restore(dests[st.rows.info.name])
        made: dict[tuple[str, torch.dtype, torch.device, bool], Any] = {}
        for u in st.units:
            for s in u.slots:
                key = (s.info.name, s.dtype, s.device, s.param)
                if key not in made:
                    t = dests[s.info.name].to(s.device, s.dtype)
                    made[key] = nn.Parameter(t, requires_grad=s.requires_grad) if s.param else t
                s.put(made[key])
            _unwrap(u.module, u.had_forward, u.orig_forward, "forward")
            _unwrap(u.module, u.orig_apply is not None, u.orig_apply, "_apply")
        _unwrap(model, st.root_had_forward, st.root_forward, "forward")
        if st.experts is not None:
            st.experts.restore()
        delattr(model, STREAM_ATTR)
        st.close()
    return model


def _unwrap(mod: nn.Module, had: bool, orig: Any, attr: str) -> None:
    if had:
        setattr(mod, attr, orig)
    else:
        mod.__dict__.pop(attr, None)


def stats(model: nn.Module) -> dict[str, Any]:
    """Statistics of a streamed model: `forwards`, `unit_reads` (units read into the pool), `bytes_read`,
    `hits` (unit reads finished before the unit ran: prefetch hits) and `stalls` (the forward waited),
    `cache_hits` (units still in the pool from the pass before: with a budget that holds every unit,
    nothing is read again), `wait_s` (seconds forwards waited for reads), `resyncs` (units run out of
    the recorded order), `resident_bytes` (tensors outside units, in memory), `streamed_bytes` (all
    units), `units`, `budget_bytes`, `pool_peak_bytes`, `order_recorded`, `prefetch`; for a model with
    experts, `experts`: the expert cache's (deepnvme.offload.experts.ExpertStreamer.stats); when the input
    table is read by rows (deepnvme.offload.infer.rows), `row_lookups`, `rows_read`, `row_bytes_read` and
    `row_table_bytes`."""
    st = streamer_of(model)
    with st.lock:
        out = dict(st.counts)
        out["units"] = len(st.units)
        out["streamed_bytes"] = sum(b.nbytes for u in st.units for b in u.blobs)
        out["budget_bytes"] = st.space.pool.capacity
        out["pool_peak_bytes"] = st.space.pool.peak_in_use
        out["order_recorded"] = st.order is not None
        out["prefetch"] = st.prefetch
        if st.experts is not None:
            out["experts"] = st.experts.stats()
        if st.rows is not None:
            out.update(st.rows.counts)
            out["row_table_bytes"] = st.rows.info.nbytes
    return out


__all__ = ["stats", "stream_weights", "unstream"]
