#!/usr/bin/env python3
"""One contender of bench/stream_bench.py in a process of its own: load a causal LM its way, decode, report.

    python3 bench/stream_child.py '<json spec>'

Started by stream_bench.py inside a memory cgroup (the cgroup's limit is its business, not this file's).
The spec names the contender and the files:

- ``memory``: ``AutoModelForCausalLM.from_pretrained(model_dir)``, every weight in memory;
- ``accelerate``: the same with ``device_map="auto"``, ``max_memory={"cpu": max_memory}`` and
  ``offload_folder``: what transformers and accelerate give a user whose model does not fit;
- ``deepnvme-one-call``: ``deepnvme.offload.from_pretrained(model_dir, budget)``, the Hugging Face directory
  read in place;
- ``deepnvme-store``: the model built on the meta device (``accelerate.init_empty_weights``), then
  ``deepnvme.offload.stream_weights(model, store, budget)`` with deepnvme's own store.

Then, for each batch size: the page cache of every data file dropped, a greedy prefill of a fixed prompt that
yields the warm-up token (a streamed model records its execution order there), and ``tokens`` timed decode
steps with the KV cache, each one forward of the last token. Printed as the last stdout line,
``RESULT <json>``: seconds per step, the tokens (so the parent can check every contender decoded the same),
bytes the process read from the drive per step (``/proc/self/io``), deepnvme's ``stats()`` over the timed
steps, load seconds and the process's peak resident memory (``VmHWM``); at batch 1 of a streamed MoE also
the replay of its routed expert reads alone (``routed_replay``, see RoutedReads).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from _harness import evict_tree, greedy_steps, status_bytes  # first: puts this checkout on sys.path

CONTENDERS = ("memory", "accelerate", "deepnvme-one-call", "deepnvme-store")


def drive_read_bytes() -> int:
    """Bytes this process has caused to be fetched from storage (``read_bytes`` of /proc/self/io): page-cache
    misses and direct reads alike, whoever issued them (accelerate's memory maps, deepnvme's handle)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("no read_bytes in /proc/self/io")


def numeric(d: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a stats() dict (nested dicts flattened with '.'), for differences."""
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in numeric(v).items()})
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
    return out


def load(spec: dict[str, Any]) -> Any:
    """The model, loaded the contender's way, in eval mode."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, model_dir = spec["contender"], spec["model_dir"]
    if kind == "memory":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    elif kind == "accelerate":
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, device_map="auto", max_memory={"cpu": spec["max_memory"]},
            offload_folder=spec["offload_dir"])
    elif kind == "deepnvme-one-call":
        from deepnvme.offload import from_pretrained

        model = from_pretrained(model_dir, spec["budget"], dtype=torch.float32,
                                expert_lookahead=spec.get("expert_lookahead", 0))
    elif kind == "deepnvme-store":
        from accelerate import init_empty_weights

        from deepnvme.offload import stream_weights

        config = AutoConfig.from_pretrained(model_dir)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = stream_weights(model, spec["store_dir"], spec["budget"],
                               expert_lookahead=spec.get("expert_lookahead", 0))
    else:
        raise ValueError(f"contender {kind!r} is not one of {', '.join(CONTENDERS)}")
    return model.eval()


def prompt(batch: int, length: int, vocab: int) -> Any:
    """The fixed prompt: the first `batch` rows of 16 rows of seeded random token ids (no tokenizer: the
    weights are random too), the same in every contender."""
    import torch

    g = torch.Generator().manual_seed(20)
    rows = torch.randint(0, vocab, (max(16, batch), length), generator=g)
    return rows[:batch]


class RoutedReads:
    """The expert reads a streamed MoE's layers demanded, recorded while `on`: per layer's request, the
    experts it asked for that were not in memory (its misses), in order. A layer's experts are known only
    once its router has run on the output of the layer before, so these groups are a chain: `replay` reads
    them with the raw handle, group after group, nothing else running, which is the I/O time of a decode
    that reads exactly these experts when they are routed to, were its compute free. (Reads the expert
    cache's internals: a bench's probe, not an API.)"""

    def __init__(self, model: Any) -> None:
        from deepnvme.offload.infer.running import STREAM_ATTR

        experts = getattr(getattr(model, STREAM_ATTR, None), "experts", None)
        self.cache = getattr(experts, "cache", None)
        self.groups: list[list[Any]] = []
        self.on = False
        if self.cache is not None:
            request = self.cache.request

            def recorded(keys: Any) -> None:
                if self.on:
                    entries = self.cache._entries
                    with self.cache._lock:
                        missing = [entries[k] for k in keys if entries[k].lease is None]
                    if missing:
                        self.groups.append([u for e in missing for u in e.units])
                request(keys)
            self.cache.request = recorded

    def replay(self, settings: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The recorded groups read again (page cache dropped first) at each handle setting: the fastest
        setting's seconds, and the bytes."""
        import os

        import torch

        from deepnvme._core.handles import new_handle

        if not self.groups:
            return None
        paths = sorted({u.path for g in self.groups for u in g})
        evict_tree(*paths)
        fds: dict[str, int] = {}
        try:
            for p in paths:
                fds[p] = os.open(p, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            for fd in fds.values():
                os.close(fd)
            raise
        largest = max(sum(u.io_nbytes for u in g) for g in self.groups)
        best: dict[str, Any] | None = None
        try:
            for setting in settings:
                h = new_handle(**setting)
                buf = h.new_cpu_locked_tensor(largest, torch.empty(0, dtype=torch.uint8))
                try:
                    t0 = time.perf_counter()
                    for g in self.groups:
                        at = 0
                        for u in g:
                            h.async_pread(buf[at:at + u.io_nbytes], fds[u.path], u.io_start)
                            at += u.io_nbytes
                        h.wait()
                    secs = time.perf_counter() - t0
                finally:
                    h.free_cpu_locked_tensor(buf)
                if best is None or secs < best["seconds"]:
                    best = {"seconds": secs, "setting": setting}
        finally:
            for fd in fds.values():
                os.close(fd)
        return {**best, "groups": len(self.groups),
                "bytes": sum(u.io_nbytes for g in self.groups for u in g)}


def routed_replay(routed: RoutedReads, settings: list[dict[str, Any]], window: dict[str, float]
                  ) -> dict[str, Any]:
    """The replay of the routed reads recorded over the timed steps (RoutedReads.replay), or why there is
    none: only demand reads are a chain, so a window with guesses or reads ahead has no replay, nor one
    whose recorded reads are not exactly the expert bytes the cache read (an expert evicted and read again
    within a layer). A replay that fails says how, and the decode's figures stay."""
    if window.get("experts.guessed_reads", 0.0) or window.get("experts.ahead_reads", 0.0):
        return {"error": "guessed or read-ahead expert reads in the timed steps: not a chain of demand reads"}
    recorded = sum(u.io_nbytes for g in routed.groups for u in g)
    if recorded != window.get("experts.bytes_read", 0.0):
        return {"error": f"recorded {recorded} bytes of routed reads, the cache read "
                         f"{window.get('experts.bytes_read', 0.0):.0f}"}
    try:
        return routed.replay(settings) or {"error": "no expert was read in the timed steps"}
    except (OSError, RuntimeError, ValueError) as exc:
        return {"error": f"the replay failed: {exc}"}


def decode(model: Any, batch: int, tokens: int, prompt_len: int, drop: list[str], streamed: bool,
           replay_settings: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Greedy decoding from a cold page cache: the prefill gives the warm-up token, then `tokens` steps of
    one token per sequence are timed one by one, with the KV cache, logits of the last position only.
    `streamed`: deepnvme streams the model (its stats() answers). `replay_settings` (batch 1 of a streamed
    MoE): the timed steps' routed expert reads are recorded and replayed alone (RoutedReads)."""
    import torch

    stats = None
    if streamed:
        from deepnvme.offload import stats
    routed = RoutedReads(model) if streamed and replay_settings else None
    left = evict_tree(*drop)
    ids = prompt(batch, prompt_len, model.config.vocab_size)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        warm = time.perf_counter() - t0
        cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        before = numeric(stats(model)) if stats else {}
        io0 = drive_read_bytes()
        if routed is not None:
            routed.on = True
        steps, made = greedy_steps(model, nxt, cache, tokens)
        made.insert(0, nxt)
        io1 = drive_read_bytes()
        after = numeric(stats(model)) if stats else {}
    replay: dict[str, Any] | None = None
    if routed is not None:
        routed.on = False
        replay = routed_replay(routed, replay_settings or [],
                               {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})
    return {"batch": batch, "routed_replay": replay, "warmup_s": warm, "step_s": steps,
            "tokens_per_s": batch * len(steps) / sum(steps) if steps else 0.0,
            "drive_bytes_per_step": (io1 - io0) / max(1, len(steps)),
            "pages_left_cached": left,
            "tokens": torch.cat(made, dim=1).tolist(),
            "stats": {k: after[k] - before.get(k, 0.0) for k in after},
            "stats_total": after}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[1])
    import torch

    torch.manual_seed(0)
    t0 = time.perf_counter()
    io0 = drive_read_bytes()
    model = load(spec)
    result: dict[str, Any] = {"contender": spec["contender"], "load_s": time.perf_counter() - t0,
                              "load_drive_bytes": drive_read_bytes() - io0, "runs": []}
    if spec["contender"] == "accelerate":
        result["device_map"] = {k: str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    for batch in spec["batches"]:
        streamed = spec["contender"].startswith("deepnvme")
        # The limits of the report are deepnvme-store's: only its batch-1 reads are replayed.
        replay = spec.get("replay_settings") if batch == 1 and spec["contender"] == "deepnvme-store" else None
        result["runs"].append(decode(model, batch, spec["tokens"], spec["prompt_len"], spec["drop"], streamed,
                                     replay))
    result["peak_rss"] = status_bytes("VmHWM")["VmHWM"]
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
