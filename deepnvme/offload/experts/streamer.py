"""Experts streamed as units of their own: what stream_weights does with a model's Mixture-of-Experts layers.

Each expert (sets.py finds them and maps them to the store) is a key of an `ExpertCache` with its
own part of the budget; its tensors become placeholders. An expert is read only when tokens are routed to
it, and stays cached (least recently used evicted) for the next tokens:

* ``modules`` sets (deepnvme.moe): the MoE layer runs only the experts that keep a token at inference and
  tells the set which ones first (`Experts.before_run`): the cache queues their reads in that order, and
  each expert's forward demands its own, runs on views of the cached bytes and hands them back.
* ``fused`` sets (Hugging Face, transformers 5): the experts module's forward is replaced by one that reads
  the experts `top_k_index` names and calls the module's own forward (the configured implementation:
  eager, grouped_mm, batched_mm) on 3-D tensors holding only those experts, with the indices renumbered.
  The results are those of the whole tensors bit for bit (each expert's rows are computed alike, in the
  same order). When the experts fit the cache together and lie in the pool in expert order at one stride
  (the cache places a layer's reads so), those tensors are views of the cached bytes: nothing is copied;
  else they are copied into a buffer kept from call to call, the only expert memory outside the budget
  (on a GPU it is the device copy that would be made anyway).
* Read-ahead when nearly every expert will be used: once a layer has routed, if its tokens are expected to
  use at least `FULL_USE` of its experts (`expected_share`), the experts of the layers after it are read
  ahead in the order they will run, as the dense units are, as far as the cache has room, the window
  sliding as each expert is released (ExpertCache.read_ahead): the drive reads the next layers while this
  one computes. It goes on into the next forward's first layers when that forward, expected to decode one
  token per sequence of this one, is expected to use as many (a batch decoding; not a single sequence
  after its prompt). Below that share, reading every expert would mostly read what no token needs, so
  experts are read only when routed to (or guessed, below). Those read ahead and then not routed to are
  counted as wasted guesses.
* Pre-gating (`lookahead` > 0, fused sets whose router is found beside them, below `FULL_USE`): each layer
  applies the next layers' routers to its own input and reads the experts they pick behind its own
  (ExpertCache.prefetch), so the drive reads while the CPU computes; a guess changes no result, and its
  bytes are counted.

The budget is split (budget.py, `split_budget`): the dense units (the blocks without their experts) get
all they need to stay in memory when that is at most half of it, else room for two of the largest (one
running, one read ahead); the experts all the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deepnvme.offload._doors import GroupedExperts, stack_views
from deepnvme.offload.experts.budget import FULL_USE, expected_share
from deepnvme.offload.experts.cache import ExpertCache
from deepnvme.offload.experts.fused import FewExperts, hooked_inside
from deepnvme.offload.experts.sets import FUSED, ExpertSet, Part, expert_parts, find_expert_sets
from deepnvme.offload.model import Placeholder
from deepnvme.offload.stores import Blob, Store, check, lease_bytes, runs, tensor_in
from deepnvme.offload.swap import Lease, SwapSpace

_MISSING = object()  # an attribute the module's __dict__ did not have before it was wrapped

@dataclass
class _Expert:
    key: tuple[int, int]
    parts: list[Part]
    blobs: list[Blob]
    lease_bytes: int
    units: list[Any] = field(default_factory=list)


class ExpertStreamer:
    """The expert sets of one streamed model and the cache they are read through."""

    def __init__(self, model: nn.Module, store: Store, sets: list[ExpertSet], lookahead: int = 1,
                 read_ahead: bool = True) -> None:

        self.model, self.store, self.sets = model, store, sets
        self.owned = {id(t) for s in sets for t in s.tensors()}
        tensors = store.tensors()
        self.experts: dict[tuple[int, int], _Expert] = {}
        for si, s in enumerate(sets):
            for e in range(s.num_experts):
                parts = expert_parts(model, s, e, tensors, store.path)
                infos = list({p.info.name: p.info for p in parts}.values())
                if all(tensors.get(i.name) is i for i in infos):
                    blobs = store.blobs([i.name for i in infos])
                else:  # slices of fused tensors: ranges the store does not list
                    blobs = runs(infos)
                self.experts[(si, e)] = _Expert((si, e), parts, blobs, lease_bytes(blobs))
        self.largest = max(x.lease_bytes for x in self.experts.values())
        sizes = {x.lease_bytes for x in self.experts.values()}
        self.uniform = sizes.pop() if len(sizes) == 1 else None  # the pool bytes of every expert, if one
        self.lookahead = lookahead
        self.read_ahead = read_ahead
        # For each layer, every expert of the layers after it in this forward, and of those before it (the
        # next forward's), in the order they run: what the read-ahead reads once that layer has routed.
        cycle = [(si, e) for si, s in enumerate(sets) for e in range(s.num_experts)]
        starts = [sum(s.num_experts for s in sets[:si]) for si in range(len(sets) + 1)]
        self._rest = [cycle[starts[si + 1]:] for si in range(len(sets))]
        self._next = [cycle[:starts[si]] for si in range(len(sets))]
        self._rows = 0  # sequences in the running forward (its input ids' first dimension; 0: unknown)
        self.routers: dict[int, tuple[nn.Module, int]] = {}  # set -> (its router, k)
        self.router_weights: dict[int, torch.Tensor] = {}  # set -> a copy of its router's weight
        self._hooks: list[Any] = []
        self.assembled = {"viewed": 0, "copied": 0}  # fused tensors passed as views of the cache, or copied
        self._scratch_mem: dict[tuple, torch.Tensor] = {}  # copies' memory, kept (see _scratch)
        self.cache: ExpertCache | None = None
        self._saved: list[tuple[nn.Module, str, Any]] = []  # (module, attr in __dict__, previous or None)
        # (module, attr, param, requires_grad): what restore() puts back; never the tensor itself, whose
        # memory streaming exists to free (a model loaded in memory, then streamed).
        self._placed: list[tuple[nn.Module, str, bool, bool]] = []
        self._hook: Any = None

    @staticmethod
    def for_model(model: nn.Module, store: Store, lookahead: int = 1,
                  read_ahead: bool = True) -> ExpertStreamer | None:
        """The streamer of `model`'s experts, or None when it has none; `lookahead`: how many layers ahead
        experts are guessed and read (0: only on demand); `read_ahead`: whether the next layers' experts
        are read ahead when nearly all will be used (FULL_USE)."""
        sets = find_expert_sets(model)
        return ExpertStreamer(model, store, sets, lookahead, read_ahead) if sets else None

    # ------------------------------------------------------------------------------------------ install
    def install(self, space: SwapSpace, capacity: int) -> None:
        """Create the cache (`capacity` bytes of locked memory) and put placeholders and forwards in place."""

        self.cache = ExpertCache(space, capacity)
        try:
            for x in self.experts.values():
                s = self.sets[x.key[0]]
                x.units = [space.add_external(f"{s.unit_name(x.key[1])}#{j}", b.path, b.offset, b.nbytes,
                                              pool=self.cache.pool) for j, b in enumerate(x.blobs)]
                crcs = [(b, u) for b, u in zip(x.blobs, x.units) if b.crc is not None]
                self.cache.add(x.key, x.units, _crc_check(crcs) if crcs else None, group=x.key[0])
        except BaseException:
            self.cache.close()
            raise
        for si, s in enumerate(self.sets):
            if s.kind == FUSED:
                for p in s.params:
                    t = s.module._parameters[p]
                    self._placed.append((s.module, p, True, t.requires_grad))
                    s.module._parameters[p] = Placeholder(f"{s.name}.{p}", f"{s.name} (its experts)",
                                                          t.shape, t.dtype, _device(t))
                self._wrap(s.module, "forward", self._fused_forward(si, s))
            else:
                for e, expert in enumerate(s.module.deepspeed_experts):
                    for slot in s.slots(e):
                        table = slot.module._parameters if slot.param else slot.module._buffers
                        t = table[slot.attr]
                        self._placed.append((slot.module, slot.attr, slot.param, t.requires_grad))
                        table[slot.attr] = Placeholder(slot.name, s.unit_name(e), t.shape, t.dtype,
                                                       _device(t))
                    self._wrap(expert, "forward", self._expert_forward(si, e, expert))
                self._wrap(s.module, "before_run", self._before_run(si))
                if GroupedExperts.of(s.module.deepspeed_experts) is not None:
                    self._wrap(s.module, "run_streamed", self._grouped_rows(si, s))
            self._wrap(s.module, "_apply", self._apply(s))
        self._hook = self.model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
        if self.lookahead:
            self._find_routers()

    def _wrap(self, mod: nn.Module, attr: str, value: Any) -> None:
        self._saved.append((mod, attr, mod.__dict__.get(attr, _MISSING)))
        if attr in ("before_run", "run_streamed"):
            setattr(mod, attr, value)
        else:
            mod.__dict__[attr] = value

    def _apply(self, s: ExpertSet) -> Any:
        """`model.to(...)`, `.half()` and the like on an expert set: its placeholders take the new device
        and dtype (reads are converted to them), the rest of the module is moved as usual."""

        mod = s.module

        def _apply(fn: Any, recurse: bool = True) -> nn.Module:
            held = []
            for m in mod.modules():
                for table in (m._parameters, m._buffers):
                    for attr, t in table.items():
                        if isinstance(t, Placeholder):
                            probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
                            held.append((table, attr, t, probe.dtype, probe.device))
                            table[attr] = None
            try:
                type(mod)._apply(mod, fn, recurse)
            finally:
                for table, attr, t, dtype, device in held:
                    table[attr] = Placeholder(t._name, t._unit, t.shape, dtype, device)
            return mod
        return _apply

    def _count_tokens(self, _mod: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        if ids is None:
            ids = next((a for a in args if isinstance(a, torch.Tensor) and not a.is_floating_point()), None)
        if isinstance(ids, torch.Tensor) and self.cache is not None:
            self.cache.count_tokens(ids.numel())
        self._rows = (ids.shape[0] if ids.dim() >= 2 else 1) if isinstance(ids, torch.Tensor) else 0

    # ------------------------------------------------------------------------------------------ reads
    def _tensors(self, x: _Expert, lease: Lease) -> dict[str, list[tuple[Part, torch.Tensor]]]:
        """Expert x's parts as views of the cached bytes, by target tensor name."""
        where = {}
        for b, u in zip(x.blobs, x.units):
            data = lease.view(u)
            for info in b.tensors:
                where[info.name] = (b, info, data)
        out: dict[str, list[tuple[Part, torch.Tensor]]] = {}
        for p in x.parts:
            b, info, data = where[p.info.name]
            out.setdefault(p.target, []).append((p, tensor_in(b, info, data)))
        return out

    def _before_run(self, si: int) -> Any:
        def before_run(indices: list[int]) -> None:
            self.cache.request([(si, e) for e in indices])  # type: ignore[union-attr]
            # A deepnvme.moe layer tells its experts which run, not its tokens or k: the share it uses is
            # what the next layers, seeing the same tokens, are expected to use.
            self._look_ahead(si, len(indices) / max(1, self.sets[si].num_experts), None, None)
        return before_run

    def _expert_forward(self, si: int, e: int, expert: nn.Module) -> Any:
        s, x = self.sets[si], self.experts[(si, e)]
        orig = type(expert).forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            cache = self.cache
            # The expert computes while its bytes' CRC is checked on the check thread; its output is
            # returned only once the check has passed (unless a hook inside it would see what it computes:
            # then the check comes first).
            unchecked = not hooked_inside(expert)
            placeholders: list[tuple[dict, str, Any]] = []
            lease = None
            try:
                lease = cache.acquire(x.key, checked=not unchecked)  # type: ignore[union-attr]
                self._put_views(s, x, lease, placeholders)
                out = orig(expert, *args, **kwargs)
                if unchecked:
                    cache.confirm(x.key, lease)  # type: ignore[union-attr]
                return out
            finally:
                for table, attr, placeholder in placeholders:
                    table[attr] = placeholder
                if lease is not None:
                    cache.release(x.key)  # type: ignore[union-attr]
        return forward

    def _put_views(self, s: ExpertSet, x: _Expert, lease: Lease, placed: list[tuple[dict, str, Any]]) -> None:
        """Expert x's tensors (views of `lease`, converted where the model's dtype or device differs) in
        place of its placeholders; each replaced entry is appended to `placed`, for the caller to put
        back."""
        views = self._tensors(x, lease)
        for slot in s.slots(x.key[1]):
            table = slot.module._parameters if slot.param else slot.module._buffers
            placeholder = table[slot.attr]
            placed.append((table, slot.attr, placeholder))
            v = views[slot.name][0][1]
            if v.dtype != placeholder.dtype or v.device != placeholder.device:
                v = v.to(placeholder.device, placeholder.dtype)
            table[slot.attr] = v

    def _grouped_rows(self, si: int, s: ExpertSet) -> Any:
        """A deepnvme.moe set's experts computed together (Experts.run_streamed): the routed experts' leases
        held at once, their views put in place of the placeholders, one GroupedExperts over them; the same
        per-expert arithmetic as the in-memory layer's grouped path, which runs every expert with its rows
        (an expert without rows adds nothing). None (the experts then run one by one through their own
        forwards) when they do not fit the cache together or a hook or autocast asks for the loop."""

        def run(rows: torch.Tensor, counts: list[int], impl: str) -> torch.Tensor | None:
            active = [e for e, n in enumerate(counts) if n]
            modules = [s.module.deepspeed_experts[e] for e in active]
            plan = GroupedExperts.of(modules) if active and self._fit_together(len(active)) else None
            if plan is None:
                return None
            cache = self.cache
            unchecked = not any(hooked_inside(m) for m in modules)
            held: list[tuple[tuple[int, int], Any]] = []
            placed: list[tuple[dict, str, Any]] = []
            try:
                for e in active:
                    key = (si, e)
                    lease = cache.acquire(key, checked=not unchecked)  # type: ignore[union-attr]
                    held.append((key, lease))
                    self._put_views(s, self.experts[key], lease, placed)
                if not plan.ready(rows, streamed=True):
                    return None
                out = plan.run(rows, [counts[e] for e in active], impl)
                if unchecked:
                    for key, lease in held:
                        cache.confirm(key, lease)  # type: ignore[union-attr]
                return out
            finally:
                for table, attr, placeholder in placed:
                    table[attr] = placeholder
                for key, _ in held:
                    cache.release(key)  # type: ignore[union-attr]
        return run

    def _fused_forward(self, si: int, s: ExpertSet) -> Any:
        orig = type(s.module).forward
        module = s.module

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    *args: Any, **kwargs: Any) -> Any:
            cache = self.cache
            keys = [(si, e) for e in torch.unique(top_k_index).tolist() if 0 <= e < s.num_experts]
            cache.request(keys)  # type: ignore[union-attr]
            k = top_k_index.shape[-1] if top_k_index.dim() else 1
            share = expected_share(top_k_index.numel() // max(1, k), k, s.num_experts)
            self._look_ahead(si, share, hidden_states, k)  # queued behind this layer's own reads
            held: list[tuple[tuple[int, int], Any]] = []
            unchecked = not hooked_inside(module)
            try:
                if self._fit_together(len(keys)):
                    views = {}
                    for key in keys:
                        # Computed with while their CRCs are checked; confirmed before the output leaves.
                        lease = cache.acquire(key, checked=not unchecked)  # type: ignore[union-attr]
                        held.append((key, lease))
                        views[key] = self._tensors(self.experts[key], lease)
                    # At most two (token, expert) pairs: each expert computes one row alone, and a token's
                    # outputs are summed in its routing order, or two of them in either order (the same
                    # bits): the experts may come in the order they lie in the pool, so that views serve.
                    keys, compact = self._stacked(s, keys, views, hidden_states.device,
                                                  any_order=top_k_index.numel() <= 2)
                else:
                    compact = self._copied(s, keys, hidden_states.device)
                hit = [e for _, e in keys]
                like = {"dtype": top_k_index.dtype, "device": top_k_index.device}
                lut = torch.full((s.num_experts + 1,), len(hit), **like)  # type: ignore[arg-type]
                if hit:
                    lut[torch.tensor(hit, device=top_k_index.device)] = torch.arange(len(hit), **like)
                index = lut[top_k_index.clamp(0, s.num_experts)]
                proxy = FewExperts(module, num_experts=len(hit), **compact)
                out = orig(proxy, hidden_states, index, top_k_weights, *args, **kwargs)
                if unchecked:
                    for key, lease in held:
                        cache.confirm(key, lease)  # type: ignore[union-attr]
                return out
            finally:
                for key, _ in held:
                    cache.release(key)  # type: ignore[union-attr]
        return forward

    def _fit_together(self, n: int) -> bool:
        """Whether n experts can be held at once: every expert of the cache takes the same pool bytes (so
        first-fit never fragments the pool) and n of them fit its capacity."""
        return self.uniform is not None and n * self.uniform <= self.cache.pool.capacity  # type: ignore[union-attr]

    def _stacked(self, s: ExpertSet, keys: list[tuple[int, int]], views: dict[tuple[int, int], Any],
                 device: torch.device, any_order: bool = False
                 ) -> tuple[list[tuple[int, int]], dict[str, torch.Tensor]]:
        """The experts' 3-D tensors for one call, in the order of `keys` (ascending expert ids: the order
        the whole tensor has, so that each token's rows reach the kernel in the same order and the
        results are the same to the bit), as views of the cached bytes where they can be (no copy: each
        expert is one slice in the store and the slices lie at one stride in the pool, in that order),
        else copied; and the keys, in the order used. With `any_order` (the caller knows the order
        changes no result) the keys are put in the order their bytes lie in the pool first."""
        def whole(key: tuple[int, int], p: str) -> torch.Tensor | None:
            ph = s.module._parameters[p]
            pieces = views[key][f"{s.unit_name(key[1])}.{p}"]
            if len(pieces) != 1:
                return None
            part, v = pieces[0]
            if part.start != 0 or part.stop != ph.shape[1] or v.dtype != ph.dtype or v.device != device:
                return None
            return v if v.is_contiguous() else None

        if any_order and len(keys) > 1:
            first = {k: whole(k, s.params[0]) for k in keys}
            keys = sorted(keys, key=lambda k: first[k].data_ptr() if first[k] is not None else 0)  # type: ignore[union-attr]
        out = {}
        for p in s.params:
            stacked = stack_views([whole(k, p) for k in keys])
            self.assembled["viewed" if stacked is not None else "copied"] += 1
            if stacked is None:
                ph = s.module._parameters[p]
                stacked = self._scratch(p, len(keys), ph, device)
                for i, key in enumerate(keys):
                    for part, v in views[key][f"{s.unit_name(key[1])}.{p}"]:
                        stacked[i, part.start:part.stop].copy_(v)
            out[p] = stacked
        return keys, out

    def _copied(self, s: ExpertSet, keys: list[tuple[int, int]],
                device: torch.device) -> dict[str, torch.Tensor]:
        """The experts' 3-D tensors copied out of the cache one expert at a time (more experts than the
        cache holds at once)."""
        cache = self.cache
        out = {}
        for p in s.params:
            ph = s.module._parameters[p]
            out[p] = self._scratch(p, len(keys), ph, device)
            self.assembled["copied"] += 1
        for i, key in enumerate(keys):
            lease = cache.acquire(key)  # type: ignore[union-attr]
            try:
                for target, pieces in self._tensors(self.experts[key], lease).items():
                    attr = target.rsplit(".", 1)[1]
                    for part, v in pieces:
                        out[attr][i, part.start:part.stop].copy_(v)
            finally:
                cache.release(key)  # type: ignore[union-attr]
        return out

    def _scratch(self, p: str, n: int, ph: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Memory for n experts' copies of parameter `p`, kept from call to call (grown when a call needs
        more): a fresh tensor of this size each layer would be new pages each time, faulted in and zeroed
        by the kernel, which costs about as much as the copy. Layers run one at a time (the model's lock)
        and the experts' forward keeps nothing of its weights, so one buffer per parameter serves all."""
        shape = tuple(ph.shape[1:])
        key = (p, shape, ph.dtype, device)
        have = self._scratch_mem.get(key)
        if have is None or have.shape[0] < n:
            self._scratch_mem.pop(key, None)  # the old one goes before the larger one is made
            have = self._scratch_mem[key] = torch.empty((n, *shape), dtype=ph.dtype, device=device)
        return have[:n]

    # ------------------------------------------------------------------------------------------ guesses
    def _look_ahead(self, si: int, share: float, hidden: torch.Tensor | None, k: int | None) -> None:
        """After layer si has routed (`k` experts per token, None when not told) and requested its experts,
        `share` being the share of its experts its tokens are expected to use: when that is at least
        FULL_USE, the read-ahead of every expert of the layers after it in this forward, and of the next
        forward's first layers when that forward, expected to decode one token per sequence of this one,
        is expected to use as many (a batch of 16 decoding, not one sequence after its prompt); else no
        read-ahead (and the pre-gating guesses, when on)."""
        cache = self.cache
        if self.read_ahead and share >= FULL_USE:
            keys = self._rest[si]
            if k is not None and expected_share(self._rows, k, self.sets[si].num_experts) >= FULL_USE:
                keys = keys + self._next[si]
            cache.read_ahead(keys)  # type: ignore[union-attr]
            return
        cache.read_ahead(())  # type: ignore[union-attr]
        if hidden is not None:
            self._guess(si, hidden)

    def _find_routers(self) -> None:
        """For each fused set, the router beside it (a sibling module with a weight of one row per expert,
        as Mixtral's `gate`) and its k; the next layers' experts are guessed with it. Its weight lives in
        a streamed block, so a copy is kept the first time the router runs (a few kilobytes)."""
        names = dict(self.model.named_modules())
        k_default = getattr(getattr(self.model, "config", None), "num_experts_per_tok", None)
        for si, s in enumerate(self.sets):
            if s.kind != FUSED or "." not in s.name:
                continue
            parent = names.get(s.name.rsplit(".", 1)[0])
            if parent is None:
                continue
            for child in parent.children():
                w = child._parameters.get("weight") if child is not s.module else None
                if w is None or w.dim() != 2 or w.shape[0] != s.num_experts:
                    continue
                k = getattr(child, "top_k", None) or getattr(parent, "top_k", None) or k_default
                if isinstance(k, int) and 0 < k <= s.num_experts:
                    self.routers[si] = (child, k)
                    self._hooks.append(child.register_forward_pre_hook(self._keep_router(si)))
                break

    def _keep_router(self, si: int) -> Any:
        def hook(mod: nn.Module, _args: Any) -> None:
            w = mod._parameters["weight"]
            kept = self.router_weights.get(si)
            if kept is None or kept.dtype != w.dtype or kept.device != w.device:
                with torch.no_grad():
                    self.router_weights[si] = w.detach().clone()
        return hook

    def _guess(self, si: int, hidden: torch.Tensor) -> None:
        """Queue reads of the experts the next `lookahead` layers' routers pick for `hidden` (this layer's
        input: the stream of hidden states changes little from one layer to the next), most picked first;
        the experts ranked in the top 2k are kept from eviction to make room for them (nearly picked: a
        cached one is worth more than a read). Only reads are guessed: each layer still routes its own
        input, so a wrong guess costs a read, never a different output."""
        for nxt in range(si + 1, min(si + 1 + self.lookahead, len(self.sets))):
            w = self.router_weights.get(nxt)
            if w is None or hidden.dim() != 2 or hidden.shape[-1] != w.shape[1]:
                continue
            k = self.routers[nxt][1]
            with torch.no_grad():
                ranks = torch.nn.functional.linear(hidden.to(w.device, w.dtype), w).argsort(
                    dim=-1, descending=True, stable=True)
                picks = torch.bincount(ranks[:, :k].reshape(-1), minlength=w.shape[0])
                near = torch.bincount(ranks[:, :2 * k].reshape(-1), minlength=w.shape[0])
            order = [e for e in picks.argsort(descending=True, stable=True).tolist() if picks[e] > 0]
            keep = [(nxt, e) for e in range(w.shape[0]) if near[e] > 0]
            if not self.cache.prefetch([(nxt, e) for e in order], keep):  # type: ignore[union-attr]
                return  # no room for this layer's guesses: none for the layers after it either

    # ------------------------------------------------------------------------------------------ undo, report
    def restore(self) -> None:
        """Every expert tensor back in memory (read through the cache), the forwards the model's own."""
        cache = self.cache
        cache.read_ahead(())  # type: ignore[union-attr]  # every expert is read once below, in its own order
        fused: dict[tuple[int, str], torch.Tensor] = {}
        values: dict[tuple[int, str], torch.Tensor] = {}
        for (si, e), x in self.experts.items():
            s = self.sets[si]
            lease = cache.acquire(x.key)  # type: ignore[union-attr]
            try:
                for target, pieces in self._tensors(x, lease).items():
                    for part, v in pieces:
                        if s.kind == FUSED:
                            attr = target.rsplit(".", 1)[1]
                            ph = s.module._parameters[attr]
                            whole = fused.get((si, attr))
                            if whole is None:
                                whole = torch.empty(ph.shape, dtype=ph.dtype, device=ph.device)
                                fused[(si, attr)] = whole
                            whole[e, part.start:part.stop].copy_(v)
                        else:
                            values[(si, target)] = v.clone()
            finally:
                cache.release(x.key)  # type: ignore[union-attr]
        for mod, attr, prev in reversed(self._saved):
            if prev is _MISSING:
                mod.__dict__.pop(attr, None)
            else:
                mod.__dict__[attr] = prev
        if any(s.kind != FUSED for s in self.sets):
            for s in self.sets:
                if s.kind != FUSED:
                    s.module.before_run = None
        names = {}
        for si, s in enumerate(self.sets):
            if s.kind == FUSED:
                for p in s.params:
                    names[(id(s.module), p)] = (si, p)
            else:
                for e in range(s.num_experts):
                    for slot in s.slots(e):
                        names[(id(slot.module), slot.attr)] = (si, slot.name)
        for mod, attr, param, grad in self._placed:
            si, key = names[(id(mod), attr)]
            table = mod._parameters if param else mod._buffers
            ph = table[attr]
            value = fused[(si, key)] if self.sets[si].kind == FUSED else values[(si, key)]
            value = value.to(ph.device, ph.dtype)
            table[attr] = nn.Parameter(value, requires_grad=grad) if param else value
        self._placed = []
        self._unhook()

    def stats(self) -> dict[str, Any]:
        """The cache's statistics (cache.py, ExpertCache.stats), the experts' count and bytes, the
        layers ahead whose experts are guessed (`lookahead`; 0 when no router was found), whether experts
        are read ahead when nearly all will be used (`read_ahead`), and for fused
        sets how many of the 3-D tensors handed to the experts' forward were views of the cache
        (`fused_viewed`) or copies (`fused_copied`)."""
        out = self.cache.stats() if self.cache is not None else {}
        out["experts"] = len(self.experts)
        out["lookahead"] = self.lookahead if self.routers else 0
        out["read_ahead"] = self.read_ahead
        out["fused_viewed"], out["fused_copied"] = self.assembled["viewed"], self.assembled["copied"]
        out["expert_bytes"] = sum(b.nbytes for x in self.experts.values() for b in x.blobs)
        return out

    def _unhook(self) -> None:
        self._scratch_mem.clear()
        for h in [self._hook, *self._hooks]:
            if h is not None:
                h.remove()
        self._hook, self._hooks = None, []
        self.router_weights.clear()

    def close(self) -> None:
        self._unhook()
        if self.cache is not None:
            self.cache.close()


def _device(t: torch.Tensor) -> torch.device:
    return torch.device("cpu") if t.is_meta else t.device


def _crc_check(crcs: list[tuple[Blob, Any]]) -> Any:
    def run(lease: Lease) -> None:
        for b, u in crcs:
            check(b, lease.view(u))
    return run


__all__ = ["ExpertStreamer"]
