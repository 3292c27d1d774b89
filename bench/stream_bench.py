#!/usr/bin/env python3
"""Decoding a model bigger than its memory: deepnvme's weight streaming beside accelerate's disk offload, the
model in memory and the drive's bound, every contender in the same memory cgroup, interleaved, one run.

    python3 bench/stream_bench.py [--workdir /work/benchtmp/stream] [--repeats 3] [--tokens 6] [--quick]
                                  [--budget 256M] [--overhead 1G] [--models dense,moe] [--out PREFIX]

Models (random weights, built here, nothing downloaded; saved once with ``save_pretrained`` in safetensors
under ``--workdir`` and reused while their configuration is unchanged):

- dense: GPT-2-medium-sized (``GPT2LMHeadModel``, n_embd 1024, 24 layers, 16 heads), 1.42 GB of fp32;
- moe: Mixtral-style (``MixtralForCausalLM``, hidden 1024, expert width 2048, 8 experts of which 2 per token,
  6 layers), 1.55 GB of fp32, 1.21 GB of it experts;
- llama: Llama-style (``LlamaForCausalLM``, hidden 1536, MLP width 4096, 13 layers, 12 heads of which 4 for
  keys and values, vocabulary 16000, head untied), 1.51 GB of fp32 (tables of 98 MB each, blocks of 101
  MB): deepnvme reads its input table by rows and keeps the head in memory.

Contenders, each a process of its own (bench/stream_child.py) in a fresh memory cgroup v1 whose limit is
``--budget`` + ``--overhead`` (page cache counted; created, used, removed), the page cache of every data file
dropped before each, and again in the child before each batch size:

- deepnvme-one-call: ``deepnvme.offload.from_pretrained(<the HF directory>, budget)``: the model built on
  the meta device from its config.json and its weights streamed from the directory's safetensors in place;
- deepnvme-store: the same from deepnvme's own store (``write_store``, written before any timing; rewritten
  when the model or deepnvme.offload's sources change);
- accelerate: ``from_pretrained(dir, device_map="auto", max_memory={"cpu": M}, offload_folder=...)`` with
  M = budget + the bytes deepnvme keeps resident (everything outside the transformer blocks), so both hold
  the same weight bytes in memory; transformers maps disk-offloaded weights straight to the checkpoint where
  it can and re-saves the rest (Mixtral's fused experts) into the offload folder during from_pretrained,
  outside the timing;
- memory: ``from_pretrained(dir)``, every weight in memory, in a cgroup with no limit (the model alone is
  larger than the others' limit); its peak is still recorded;
- I/O bound: batch x the best read GB/s, on the same drive in the same run, of the raw aio handle and of fio
  at the same settings (deepnvme.tools.tune.fio) / the bytes a decode step must read: every block's weights
  for the dense model, what deepnvme-store read per step (routed experts, after its cache) for the MoE;
- the MoE's limits at batch 1: deepnvme-store's routed expert reads of the timed steps replayed alone, in
  order, by the raw handle (bench/stream_child.py, RoutedReads), and those reads then the in-memory compute
  in series: what reading experts when they are routed to allows on this machine.

Decode: greedy, a fixed 16-token prompt; the prefill yields the warm-up token; then ``--tokens`` steps are
timed one by one (tokens/s = batch x steps / their seconds), at batch 1 and 16, in one child per contender;
every contender must decode the same tokens as the in-memory model. Reported per contender: tokens/s median
(min–max), the first token's seconds (the prefill from a cold cache, after the load), bytes read from the
drive per step (/proc/<pid>/io), deepnvme's stats() (bytes read, expert cache hit rate), the process's peak
RSS and the cgroup's peak (page cache included), load seconds.

Also: ``deepnvme.offload.load_safetensors`` of the dense checkpoint beside the raw handle reading the same
bytes in one request per file at each setting of a small grid (into fresh page-aligned memory, the target's
baseline, and into memory written beforehand: the drive alone; the best setting of each stands for it) and
a cold ``safetensors.torch.load_file``, in this process.

Repeats are interleaved (bench/_harness.py: contenders rotate, heats reverse every repeat; the drive's
bandwidth is measured once in each model's heat), with --rest seconds before each. --quick: 1 repeat, 4
tokens. --tiny: tiny models and sizes, to show the bench works (tests/bench/test_stream_bench_script.py).
--build_only: build the models and stores, then stop. Writes Markdown to stdout and <out>.md, every sample
to <out>.json; both are rewritten after each repeat, so a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from _harness import ROOT, evict_tree, interleave, median_range, spread  # first: this checkout on sys.path
from aio_cases import MIB, Setting, aio_seq, handle_settings

from deepnvme.tools.sizes import format_size, parse_size  # noqa: E402

GB = 1e9
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
BATCHES = (1, 16)
#: the processes each model's heat runs (bench/stream_child.py), in their order of the first repeat
CONTENDERS = ("deepnvme-store", "deepnvme-one-call", "accelerate", "memory")
PROMPT = 16
#: the issue's targets (issue 20, point 6), checked in the report
TARGETS = {"dense_store_vs_bound": 0.85, "dense_one_call_vs_bound": 0.75, "dense_vs_accelerate_b1": 1.35,
           "moe_vs_accelerate_b1": 2.5, "moe_vs_own_bound": 0.8, "load_vs_raw": 0.9}
#: issue 38's targets for the one call, at every batch: against accelerate's disk offload
ONE_CALL_TARGETS = {"llama": 2.0, "moe": 5.0}


# ------------------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class ModelSpec:
    """A model the bench builds: its transformers class and configuration, and the checkpoint prefix of its
    transformer blocks (the units deepnvme streams; the rest stays resident)."""

    name: str
    arch: str  # "gpt2" | "mixtral" | "llama"
    config: dict[str, Any]
    blocks: str

    def key(self) -> str:
        """What the built files depend on, as a short hash (the cache key under --workdir)."""
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


GPT2 = dict(n_positions=1024, vocab_size=50257)
MIXTRAL = dict(num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=False)
LLAMA = dict(max_position_embeddings=4096, tie_word_embeddings=False)
FULL = {
    "dense": ModelSpec("dense", "gpt2", {**GPT2, "n_embd": 1024, "n_layer": 24, "n_head": 16},
                       "transformer.h."),
    "moe": ModelSpec("moe", "mixtral", {**MIXTRAL, "vocab_size": 32000, "hidden_size": 1024,
                                        "intermediate_size": 2048, "num_hidden_layers": 6,
                                        "num_attention_heads": 16, "num_key_value_heads": 8,
                                        "num_local_experts": 8}, "model.layers."),
    "llama": ModelSpec("llama", "llama", {**LLAMA, "vocab_size": 16000, "hidden_size": 1536,
                                          "intermediate_size": 4096, "num_hidden_layers": 13,
                                          "num_attention_heads": 12, "num_key_value_heads": 4},
                       "model.layers."),
}
TINY = {
    "dense": ModelSpec("dense", "gpt2", {"n_positions": 64, "vocab_size": 512, "n_embd": 64, "n_layer": 2,
                                         "n_head": 2, "bos_token_id": 0, "eos_token_id": 0},
                       "transformer.h."),
    "moe": ModelSpec("moe", "mixtral", {**MIXTRAL, "vocab_size": 512, "hidden_size": 64,
                                        "intermediate_size": 128, "num_hidden_layers": 2,
                                        "num_attention_heads": 4, "num_key_value_heads": 2,
                                        "num_local_experts": 4, "max_position_embeddings": 64},
                     "model.layers."),
    "llama": ModelSpec("llama", "llama", {**LLAMA, "vocab_size": 512, "hidden_size": 64,
                                          "intermediate_size": 128, "num_hidden_layers": 2,
                                          "num_attention_heads": 4, "num_key_value_heads": 2,
                                          "max_position_embeddings": 64}, "model.layers."),
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a saved model (one, or the shards its index names)."""
    return sorted(model_dir.glob("*.safetensors"))


def tensor_bytes(model_dir: Path, blocks: str) -> tuple[int, int]:
    """(bytes of every tensor, bytes of those inside the transformer blocks), from the safetensors headers."""
    total = inside = 0
    for f in checkpoint_files(model_dir):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            size = meta["data_offsets"][1] - meta["data_offsets"][0]
            total += size
            inside += size if name.startswith(blocks) else 0
    return total, inside


def build_model(spec: ModelSpec, workdir: Path, log: Callable[[str], None]) -> Path:
    """The model's directory under `workdir`, built (random weights, seeded) unless a finished build of the
    same configuration is there. Built into a temporary name and renamed, so a killed build is not reused."""
    import torch

    out = workdir / f"{spec.name}-{spec.key()}"
    if (out / "built.json").is_file():
        return out
    log(f"building the {spec.name} model ({spec.arch}) in {out}")
    t0 = time.time()
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    torch.manual_seed(0)
    config_cls, model_cls = {"gpt2": (GPT2Config, GPT2LMHeadModel), "llama": (LlamaConfig, LlamaForCausalLM),
                             "mixtral": (MixtralConfig, MixtralForCausalLM)}[spec.arch]
    model = model_cls(config_cls(**spec.config)).eval()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    (tmp / "built.json").write_text(json.dumps(asdict(spec), indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"  built in {time.time() - t0:.0f} s")
    return out


def offload_sources_key() -> str:
    """A hash of deepnvme.offload's sources: a store written by other code is rewritten."""
    h = hashlib.sha256()
    for f in sorted((ROOT / "deepnvme" / "offload").rglob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def build_store(model_dir: Path, workdir: Path, log: Callable[[str], None]) -> Path:
    """deepnvme's own store of the model (write_store of the model loaded in memory), reused while the model
    and deepnvme.offload's sources are unchanged. Written before any timing, in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    from deepnvme.offload import write_store

    out = workdir / f"{model_dir.name}-store-{offload_sources_key()}"
    if (out / "written.json").is_file():
        return out
    log(f"writing deepnvme's store of {model_dir.name} to {out}")
    for old in workdir.glob(f"{model_dir.name}-store-*"):
        shutil.rmtree(old, ignore_errors=True)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_store(model, tmp)
    del model
    (tmp / "written.json").write_text(json.dumps({"model": model_dir.name}))
    tmp.rename(out)
    log(f"  written in {time.time() - t0:.0f} s")
    return out


# ------------------------------------------------------------------------------------------ cgroup
class MemoryCgroup:
    """A memory cgroup v1 of its own for one child: created with a limit (None: no limit; the peak is
    recorded either way), joined by the child before it execs, removed after.

    The page cache a process causes is charged to its cgroup, so a contender that reads through the cache
    (accelerate's memory maps) competes for the same bytes as one that reads with O_DIRECT into locked
    buffers. Where the kernel accounts swap, memory+swap gets the same limit, so nothing escapes to it.
    """

    def __init__(self, name: str, limit: int | None) -> None:
        self.path = CGROUP_V1 / name
        self.path.mkdir()
        try:
            if limit is not None:
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
                memsw = self.path / "memory.memsw.limit_in_bytes"
                if memsw.exists():
                    memsw.write_text(str(limit))
        except OSError:
            self.remove()
            raise

    @staticmethod
    def available() -> str | None:
        """None when memory cgroups v1 can be made here, else why not."""
        if not (CGROUP_V1 / "memory.limit_in_bytes").is_file():
            return f"no memory cgroup v1 hierarchy at {CGROUP_V1}"
        if not os.access(CGROUP_V1, os.W_OK):
            return f"{CGROUP_V1} is not writable (run as root)"
        return None

    def wrap(self, argv: list[str]) -> list[str]:
        """The command that joins this cgroup, then execs argv (the child is in it from its first byte)."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *argv]

    def peak(self) -> int:
        """The cgroup's peak charge in bytes: resident memory and page cache."""
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def oom_kills(self) -> int:
        """Processes the kernel killed for this cgroup's limit."""
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close_into(self, out: dict) -> None:
        """Record the cgroup's peak and OOM kills in a contender's result (an OOM kill named in its
        error), then remove the cgroup."""
        out["cgroup_peak"] = self.peak()
        out["oom_kills"] = self.oom_kills()
        if out["oom_kills"] and "error" in out:
            out["error"] = f"OOM-killed at the cgroup's limit ({out['oom_kills']}x); {out['error']}"
        self.remove()

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone (its page cache moves to the parent)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"could not remove the memory cgroup {self.path}")


# ------------------------------------------------------------------------------------------ contenders
@dataclass
class Model:
    """A built model and what its contenders need."""

    spec: ModelSpec
    dir: Path
    store: Path | None
    offload: Path
    total_bytes: int
    block_bytes: int
    samples: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def resident_bytes(self) -> int:
        return self.total_bytes - self.block_bytes


@dataclass
class Run:
    """One measured thing of a heat: a contender on a model, or the drive's read bandwidth."""

    model: Model | None
    name: str
    fn: Callable[[], dict]


def run_child(args: argparse.Namespace, model: Model, contender: str, log: Callable[[str], None]) -> dict:
    """One contender in a fresh cgroup from a cold cache; the child's RESULT plus the cgroup's figures.
    A child that fails or is killed gives a sample with its error instead."""
    limit = None if contender == "memory" else args.budget + args.overhead
    spec = {"contender": contender, "model_dir": str(model.dir), "store_dir": str(model.store or ""),
            "offload_dir": str(model.offload), "budget": args.budget,
            "expert_lookahead": args.expert_lookahead,
            "max_memory": args.budget + model.resident_bytes, "batches": list(BATCHES), "tokens": args.tokens,
            "prompt_len": PROMPT, "drop": [str(p) for p in (model.dir, model.store, model.offload) if p],
            # the drive bound's settings, for the replay of a streamed MoE's routed reads (stream_child)
            "replay_settings": [{k: v for k, v in handle_settings("", s.depth, s.jobs, s.block).items()
                                 if k != "engine"} for s in DriveBound.SETTINGS]}
    argv = [sys.executable, str(ROOT / "bench" / "stream_child.py"), json.dumps(spec)]
    path = [str(ROOT), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}  # the child imports this checkout's deepnvme
    evict_tree(*spec["drop"])
    group = None
    if args.cgroup:
        group = MemoryCgroup(f"deepnvme-streambench-{os.getpid()}-{contender}", limit)
        argv = group.wrap(argv)
    out: dict[str, Any] = {"contender": contender, "limit": limit}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.child_timeout,
                              check=False)
        result = next((line[7:] for line in proc.stdout.splitlines()[::-1] if line.startswith("RESULT ")),
                      None)
        if proc.returncode != 0 or result is None:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            out["error"] = f"exit {proc.returncode}: {last}"
            log(f"    {contender} failed: {out['error']}\n" + proc.stderr[-3000:])
        else:
            out.update(json.loads(result))
    except subprocess.TimeoutExpired:
        out["error"] = f"did not finish within --child_timeout {args.child_timeout:g} s"
    finally:
        if group is not None:
            group.close_into(out)
    return out


# ------------------------------------------------------------------------------------------ I/O bound
class DriveBound:
    """The drive's best sequential read: the raw handle and fio at the same settings on one laid-out file in
    --workdir (deepnvme.tools.tune.fio's rules), each setting a sample per call."""

    SETTINGS = (Setting(1 * MIB, 32, 2), Setting(8 * MIB, 32, 1))

    def __init__(self, workdir: Path, size: int) -> None:
        import torch

        from deepnvme import AsyncIOBuilder
        from deepnvme.tools.tune.fio import fio_shares, lay_out
        from op_builder.engines import by_name

        self.aio = AsyncIOBuilder().load()
        self.path = str(workdir / "bound.bin")
        self.size = size
        self.fio = shutil.which("fio")
        self.engine = self.aio.aio_handle().get_engine()
        self.fio_engine = by_name(self.engine).fio
        self.totals = {s: fio_shares(size, s.jobs, s.block)[0] * s.jobs for s in self.SETTINGS}
        lay_out(self.path, size)
        self.torch = torch
        self.samples: dict[str, list[float]] = {}

    def measure(self) -> dict:
        """One read per tool and setting; GB/s by label."""
        from deepnvme.tools.tune.fio import fio_command, run_fio_command

        got: dict[str, float] = {}
        owner = self.aio.aio_handle()
        buf = owner.new_cpu_locked_tensor(self.size, self.torch.empty(0, dtype=self.torch.uint8))
        try:
            for s in self.SETTINGS:
                total = self.totals[s]
                h = self.aio.aio_handle(**handle_settings(self.engine, s.depth, s.jobs, s.block))
                secs, _ = aio_seq(h, buf[:total], self.path, "read")()
                got[f"handle {self.engine} {s.label()}"] = total / secs / GB
                if self.fio:
                    evict_tree(self.path)
                    r = run_fio_command(fio_command(self.path, "read", self.fio_engine, s.block, s.depth,
                                                    s.jobs, total))
                    got[f"fio {self.fio_engine} {s.label()}"] = r.nbytes / r.seconds / GB
        finally:
            owner.free_cpu_locked_tensor(buf)
        for k, v in got.items():
            self.samples.setdefault(k, []).append(v)
        return got

    def best(self) -> tuple[float, str]:
        """The best median GB/s over tools and settings, and where."""
        label = max(self.samples, key=lambda k: spread(self.samples[k])["median"])
        return spread(self.samples[label])["median"], label

    def close(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


# ------------------------------------------------------------------------------------------ load section
class LoadSection:
    """load_safetensors beside the raw handle and safetensors' load_file over the same files, in this process,
    each from a cold cache.

    The raw read is the honest best of the same bytes: each file in one sync_pread, at every setting of a
    small grid (DriveBound's and 8 MiB x2), into two kinds of memory. Fresh page-aligned memory, never
    touched (what a load must hand back, as load_safetensors does: the target's baseline): the kernel
    faults each page in during the read, which on a VM costs about as much as the drive. Memory written
    beforehand, one byte per page, outside the clock (the drive alone): written, not read, since a read
    maps fresh anonymous pages to the shared zero page and the transfer then pays a copy-on-write fault
    per page, slower than fresh memory. Each kind's row is its best setting's median."""

    OURS, LOAD_FILE = "deepnvme.offload.load_safetensors", "safetensors.torch.load_file"
    RAW = "raw handle read into fresh page-aligned memory"
    RAW_TOUCHED = "raw handle read into pre-faulted memory"
    GRID = (*DriveBound.SETTINGS, Setting(8 * MIB, 32, 2))

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self.nbytes = sum(f.stat().st_size for f in files)
        self.raw = {f"{kind} ({s.label()})": (kind, s)
                    for kind in (self.RAW, self.RAW_TOUCHED) for s in self.GRID}
        self.samples: dict[str, list[float]] = {k: [] for k in (self.OURS, *self.raw, self.LOAD_FILE)}
        self.checked = False

    def runs(self) -> list[Run]:
        return [Run(None, name, lambda name=name: self.measure(name)) for name in self.samples]

    def measure(self, name: str) -> dict:
        from safetensors.torch import load_file

        from deepnvme import AsyncIOBuilder
        from deepnvme._core.memory import PAGE
        from deepnvme.offload import load_safetensors

        aio = AsyncIOBuilder().load()
        bufs: list[Any] = []
        handle = None
        if name in self.raw:
            kind, setting = self.raw[name]
            engine = aio.aio_handle().get_engine()
            handle = aio.aio_handle(**handle_settings(engine, setting.depth, setting.jobs, setting.block))
            bufs = [aio.empty_at_residue(f.stat().st_size, 0) for f in self.files]
            if kind == self.RAW_TOUCHED:
                for b in bufs:
                    b[::PAGE].fill_(0)  # written: each page really allocated (see the class docstring)
        evict_tree(*self.files)
        loaded: list[Any] = []
        t0 = time.perf_counter()
        if name == self.OURS:
            loaded = [load_safetensors(str(f), device="cpu") for f in self.files]
        elif handle is not None:
            for f, buf in zip(self.files, bufs):
                handle.sync_pread(buf, str(f))
        else:
            loaded = [load_file(str(f)) for f in self.files]
        secs = time.perf_counter() - t0
        self.samples[name].append(secs)
        if not self.checked and name == self.OURS:
            self._check(loaded)
        return {"seconds": secs}

    def _check(self, loaded: list[dict]) -> None:
        """Once: every tensor load_safetensors gave equals load_file's (a fast wrong load is no load)."""
        import torch
        from safetensors.torch import load_file

        for f, got in zip(self.files, loaded):
            want = load_file(str(f))
            bad = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
            if bad or set(got) != set(want):
                raise RuntimeError(f"load_safetensors({f}) differs from load_file at {bad[:3] or 'its keys'}")
        self.checked = True

    def summary(self) -> dict:
        rates = {k: [self.nbytes / s / GB for s in v] for k, v in self.samples.items() if v}
        med = {k: spread(v)["median"] for k, v in rates.items()}
        for kind in (self.RAW, self.RAW_TOUCHED):  # each kind's best setting stands for it
            got = [k for k in self.raw if self.raw[k][0] == kind and k in med]
            if got:
                med[kind] = max(med[k] for k in got)

        def over(a: str, b: str) -> float | None:
            return med[a] / med[b] if a in med and b in med else None

        return {"bytes": self.nbytes, "gbps": rates, "vs_raw": over(self.OURS, self.RAW),
                "vs_raw_touched": over(self.OURS, self.RAW_TOUCHED),
                "vs_load_file": over(self.OURS, self.LOAD_FILE)}


# ------------------------------------------------------------------------------------------ analysis
def tokens_per_s(samples: list[dict], batch: int) -> list[float]:
    return [r["tokens_per_s"] for s in samples if "runs" in s for r in s["runs"] if r["batch"] == batch]


def per_step(samples: list[dict], batch: int, what: Callable[[dict], float | None]) -> float | None:
    """The median over a contender's samples of `what` of its run at `batch` (None when none has it)."""
    vals = [v for s in samples if "runs" in s for r in s["runs"] if r["batch"] == batch
            if (v := what(r)) is not None]
    return spread(vals)["median"] if vals else None


def bytes_per_step(run: dict) -> float | None:
    """Bytes deepnvme read per decode step over the timed steps, from stats(): the blocks' (``bytes_read``)
    plus the expert cache's (``experts.bytes_read``, the MoE's routed experts); None without stats()."""
    st = run.get("stats", {})
    if "bytes_read" not in st or not run["step_s"]:
        return None
    return (st["bytes_read"] + st.get("experts.bytes_read", 0.0)) / len(run["step_s"])


def needed_per_step(run: dict) -> float | None:
    """Like bytes_per_step, with the expert cache's ``needed_bytes`` (reads a use needed: on demand, or
    guessed and used) for the experts: what reading more on a guess must not be credited for."""
    st = run.get("stats", {})
    if "bytes_read" not in st or not run["step_s"]:
        return None
    experts = st.get("experts.needed_bytes", st.get("experts.bytes_read", 0.0))
    return (st["bytes_read"] + experts) / len(run["step_s"])


def hit_rate(run: dict) -> float | None:
    """The expert cache's hit rate over the timed steps (its hits and misses in stats()["experts"])."""
    st = run.get("stats", {})
    uses = st.get("experts.hits", 0.0) + st.get("experts.misses", 0.0)
    return st["experts.hits"] / uses if uses else None


def replay_per_step(run: dict) -> float | None:
    """Seconds per step of the replay of the run's routed expert reads alone (stream_child.RoutedReads)."""
    rp = run.get("routed_replay")
    return rp["seconds"] / len(run["step_s"]) if rp and "seconds" in rp and run["step_s"] else None


def analyse(model: Model, bound_gbps: float) -> dict:
    """Per batch: each contender's medians, the I/O bound and the ratios the issue sets targets for."""
    out: dict[str, Any] = {"model": model.spec.name, "total_bytes": model.total_bytes,
                           "block_bytes": model.block_bytes, "batches": {}}
    for b in BATCHES:
        row: dict[str, dict[str, Any]] = {}
        for name, samples in model.samples.items():
            tps = tokens_per_s(samples, b)
            row[name] = {"tokens_per_s": spread(tps) if tps else None,
                         "bytes_per_step": per_step(samples, b, bytes_per_step),
                         "needed_per_step": per_step(samples, b, needed_per_step),
                         "drive_bytes_per_step": per_step(samples, b, lambda r: r["drive_bytes_per_step"]),
                         "hit_rate": per_step(samples, b, hit_rate),
                         "replay_s": per_step(samples, b, replay_per_step),
                         "peak_rss": max((s["peak_rss"] for s in samples if "peak_rss" in s), default=None),
                         "cgroup_peak": max((s["cgroup_peak"] for s in samples if "cgroup_peak" in s),
                                            default=None),
                         "first_token_s": per_step(samples, b, lambda r: r["warmup_s"]),
                         "load_s": spread([s["load_s"] for s in samples if "load_s" in s])["median"]
                         if any("load_s" in s for s in samples) else None,
                         "errors": [s["error"] for s in samples if "error" in s]}

        def med(name: str, row: dict[str, dict[str, Any]] = row) -> float | None:
            t = row.get(name, {}).get("tokens_per_s")
            return t["median"] if t else None

        # What a step must read: every block for the dense model; for the MoE what deepnvme-store read
        # (routed experts only, after its cache), else every block.
        own = {n: row[n]["bytes_per_step"] for n in ("deepnvme-store", "deepnvme-one-call") if n in row}
        need = model.block_bytes if model.spec.arch != "mixtral" else (own.get("deepnvme-store")
                                                                         or model.block_bytes)
        bound = b * bound_gbps * GB / need if need else None
        ceiling = min(x for x in (bound, med("memory")) if x) if bound or med("memory") else None
        ratios: dict[str, float | None] = {}
        for n in ("deepnvme-store", "deepnvme-one-call"):
            if med(n) is None:
                continue
            ratios[f"{n} / min(bound, memory)"] = med(n) / ceiling if ceiling else None
            ratios[f"{n} / accelerate"] = med(n) / med("accelerate") if med("accelerate") else None
            if model.spec.arch == "mixtral" and own.get(n):
                ratios[f"{n} / own bound"] = med(n) / (b * bound_gbps * GB / own[n])
                needed = row[n]["needed_per_step"]
                if needed and abs(needed - own[n]) > 1:  # guesses read more than the uses needed
                    ratios[f"{n} / own bound of needed bytes"] = med(n) / (b * bound_gbps * GB / needed)
        # What reading experts when they are routed to allows at most: the routed reads replayed alone, and
        # those reads then the in-memory model's compute, in series (a layer's experts are known only after
        # its router ran on the layer before's output). Both credited with all of deepnvme-store's bytes.
        limits: dict[str, float] = {}
        replay_s = row.get("deepnvme-store", {}).get("replay_s")
        if replay_s and own.get("deepnvme-store") and bound_gbps:
            limits["routed reads alone"] = b / replay_s
            if med("memory"):
                limits["routed reads, then the in-memory compute, in series"] = b / (replay_s
                                                                                     + b / med("memory"))
            for what, tps in list(limits.items()):
                ratios[f"{what} / own bound"] = tps / (b * bound_gbps * GB / own["deepnvme-store"])
        out["batches"][b] = {"rows": row, "bound": bound, "bound_bytes_per_step": need, "ceiling": ceiling,
                             "limits": limits, "ratios": ratios,
                             "tokens_match": tokens_match(model.samples, b)}
    return out


def tokens_match(samples: dict[str, list[dict]], batch: int) -> dict[str, bool]:
    """Per contender that decoded at `batch`: whether every run gave exactly the in-memory model's tokens."""
    def runs(ss: list[dict]) -> list[dict]:
        return [r for s in ss if "runs" in s for r in s["runs"] if r["batch"] == batch]

    want = next((r["tokens"] for r in runs(samples.get("memory", []))), None)
    return {name: all(r["tokens"] == want for r in runs(ss))
            for name, ss in samples.items() if want is not None and name != "memory" and runs(ss)}


def verdicts(analyses: list[dict], load: dict | None) -> list[str]:
    """The issue's targets, each with its ratio and met / NOT met."""
    lines = []

    def check(label: str, value: float | None, target: float) -> None:
        if value is None:
            lines.append(f"- {label}: not measured (target ≥ {target})")
        else:
            verdict = "met" if value >= target else "NOT met"
            lines.append(f"- {label}: {value:.2f} (target ≥ {target}: {verdict})")

    for a in analyses:
        for b, cell in a["batches"].items():
            r = cell["ratios"]
            if a["model"] == "dense":
                check(f"dense, batch {b}, deepnvme-store / min(I/O bound, memory)",
                      r.get("deepnvme-store / min(bound, memory)"), TARGETS["dense_store_vs_bound"])
                check(f"dense, batch {b}, deepnvme-one-call / min(I/O bound, memory)",
                      r.get("deepnvme-one-call / min(bound, memory)"),
                      TARGETS["dense_one_call_vs_bound"])
                if b == 1:
                    for n in ("deepnvme-store", "deepnvme-one-call"):
                        check(f"dense, batch 1, {n} / accelerate", r.get(f"{n} / accelerate"),
                              TARGETS["dense_vs_accelerate_b1"])
            elif a["model"] == "moe":
                for n in ("deepnvme-store", "deepnvme-one-call"):
                    if b == 1:
                        check(f"moe, batch 1, {n} / accelerate", r.get(f"{n} / accelerate"),
                              TARGETS["moe_vs_accelerate_b1"])
                    check(f"moe, batch {b}, {n} / its own I/O bound", r.get(f"{n} / own bound"),
                          TARGETS["moe_vs_own_bound"])
            if a["model"] in ONE_CALL_TARGETS:
                check(f"{a['model']}, batch {b}, deepnvme-one-call / accelerate (issue 38)",
                      r.get("deepnvme-one-call / accelerate"), ONE_CALL_TARGETS[a["model"]])
            if a["model"] == "moe":
                for what in cell.get("limits", {}):
                    lines.append(f"- moe, batch {b}, limit of reading routed experts on demand, {what} / "
                                 f"own I/O bound (no target): {r[f'{what} / own bound']:.2f}")
    if load:
        check("load_safetensors / raw read of the same bytes into fresh memory (best setting)",
              load["vs_raw"], TARGETS["load_vs_raw"])
        if load["vs_raw_touched"] is not None:
            lines.append(f"- load_safetensors / raw read into pre-faulted memory, best setting (no target): "
                         f"{load['vs_raw_touched']:.2f}")
        check("load_safetensors / cold safetensors.torch.load_file", load["vs_load_file"], 1.0)
    return lines


# ------------------------------------------------------------------------------------------ report
def mib(x: float | None) -> str:
    return f"{x / MIB:.0f}" if x is not None else "—"


def mb(x: float | None) -> str:
    """Bytes as MB (10^6): whole above 10, two decimals below (the tiny models' steps read kilobytes)."""
    if x is None:
        return "—"
    return f"{x / 1e6:.0f}" if x >= 10e6 else f"{x / 1e6:.2f}"


def render(analyses: list[dict], models: dict[str, Model], bound: DriveBound | None, load: dict | None,
           meta: dict) -> str:
    """The Markdown report."""
    lines = [f"# Weight streaming, decode ({meta['when']}{', --quick' if meta['quick'] else ''}"
             f"{', --tiny' if meta['tiny'] else ''})", "",
             f"Command: `python3 bench/stream_bench.py {' '.join(meta['argv'])}`", "",
             f"Machine: {meta['machine']}; workdir {meta['workdir']}; load average {meta['load_before']} "
             f"before, {meta['load_after']} after. {meta['note']}".rstrip(), "",
             f"deepnvme's expert_lookahead: {meta.get('expert_lookahead', 0)}.", "",
             "Memory: every contender but `memory` in a cgroup v1 limited to budget "
             f"{format_size(meta['budget'])} + overhead {format_size(meta['overhead'])} = "
             f"{(meta['budget'] + meta['overhead']) / MIB:.6g} MiB "
             "(page cache counted); `memory` in a cgroup with no limit."
             if meta["cgroup"] else "Memory: NO cgroup (--no_cgroup): limits not enforced.", "",
             f"{meta['repeats']} interleaved repeats; {meta['tokens']} timed decode steps after a warm-up "
             f"token, prompt {PROMPT} tokens, greedy. Tokens/s: median (min–max). GB = 10^9 bytes, "
             "MiB = 2^20.", ""]
    if bound is not None and bound.samples:
        best, where = bound.best()
        lines += [f"Drive: best read {best:.2f} GB/s ({where}); every tool and setting: "
                  + "; ".join(f"{k} {median_range(v)}" for k, v in bound.samples.items()) + ".", ""]
    for a in analyses:
        m = models[a["model"]]
        lines += [f"## {a['model']}: {m.spec.arch}, {a['total_bytes'] / 1e6:,.0f} MB "
                  f"({a['block_bytes'] / 1e6:,.0f} MB in transformer blocks)", "",
                  "| batch | contender | tokens/s | ratio to min(bound, memory) | MB read/step (stats) | "
                  "MB from drive/step | expert cache hits | peak RSS MiB | cgroup peak MiB | load s | "
                  "first token s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for b, cell in a["batches"].items():
            for name, r in cell["rows"].items():
                t = r["tokens_per_s"]
                cells = [str(b), name,
                         f"{t['median']:.2f} ({t['min']:.2f}–{t['max']:.2f})" if t
                         else "failed: " + "; ".join(r["errors"][:1]),
                         f"{t['median'] / cell['ceiling']:.2f}" if t and cell["ceiling"] else "—",
                         mb(r["bytes_per_step"]), mb(r["drive_bytes_per_step"]),
                         f"{r['hit_rate']:.2f}" if r["hit_rate"] is not None else "—",
                         mib(r["peak_rss"]), mib(r["cgroup_peak"]),
                         f"{r['load_s']:.1f}" if r["load_s"] is not None else "—",
                         f"{r['first_token_s']:.2f}" if r["first_token_s"] is not None else "—"]
                lines.append("| " + " | ".join(cells) + " |")
            if cell["bound"]:
                lines.append(f"| {b} | I/O bound ({mb(cell['bound_bytes_per_step'])} MB/step) | "
                             f"{cell['bound']:.2f} | | | | | | | | |")
            for what, tps in cell.get("limits", {}).items():
                lines.append(f"| {b} | limit: {what} | {tps:.2f} | | | | | | | | |")
        lines.append("")
        for b, cell in a["batches"].items():
            bad = [n for n, ok in cell["tokens_match"].items() if not ok]
            lines.append(f"- batch {b}: " + ("every contender that ran decoded the in-memory model's tokens"
                                             if not bad else f"tokens DIFFER from the in-memory model's: "
                                             f"{', '.join(bad)}"))
            lines += [f"- batch {b}: {k} = {v:.2f}" for k, v in cell["ratios"].items() if v is not None]
        lines.append("")
    if load:
        lines += [f"## Loading a whole checkpoint ({load['bytes'] / 1e6:,.0f} MB, cold cache)", "",
                  "| contender | GB/s |", "|---|---|"]
        lines += [f"| {k} | {median_range(v)} |" for k, v in load["gbps"].items()]
        lines.append("")
    lines += ["## Targets (issues 20 and 38)", "", *verdicts(analyses, load), "", "## Notes", ""]
    lines += [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/work/benchtmp/stream",
                   help="models, stores and scratch, on the drive under test (kept for the next run)")
    p.add_argument("--models", default="dense,moe", help="comma list of dense, moe, llama")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3; --quick 1)")
    p.add_argument("--tokens", type=int, default=None,
                   help="timed decode steps per batch (default 6; --quick 4)")
    p.add_argument("--budget", default=None, help="deepnvme's locked budget (default 256M; --tiny 256K)")
    p.add_argument("--overhead", default="1G",
                   help="cgroup limit above the budget: interpreter, libraries, resident weights, KV cache")
    p.add_argument("--bound_size", default=None, help="bytes of the I/O-bound file (default 1G; --tiny 16M)")
    p.add_argument("--rest", type=float, default=1.0, help="seconds of rest before each measurement")
    p.add_argument("--sections", default="decode,load", help="comma list of decode, load")
    p.add_argument("--child_timeout", type=float, default=600.0,
                   help="seconds a contender's process may take")
    p.add_argument("--no_cgroup", dest="cgroup", action="store_false",
                   help="run without memory cgroups (limits not enforced; the report says so)")
    p.add_argument("--quick", action="store_true", help="1 repeat, 4 tokens")
    p.add_argument("--build_only", action="store_true",
                   help="build the models and deepnvme's stores under --workdir, then stop (to prebuild)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny models and sizes: shows the bench works, in seconds")
    p.add_argument("--expert_lookahead", type=int, default=0,
                   help="deepnvme's expert_lookahead (pre-gating: MoE layers ahead whose experts are "
                        "guessed and read; 0: routed experts only)")
    p.add_argument("--note", default="", help="a line for the report (e.g. 'machine busy')")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "stream"),
                   help="prefix for .md and .json")
    args = p.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick or args.tiny else 3
    if args.tokens is None:
        args.tokens = 2 if args.tiny else 4 if args.quick else 6
    try:
        args.budget = parse_size(args.budget or ("256K" if args.tiny else "256M"))
        args.overhead = parse_size(args.overhead)
        args.bound_size = parse_size(args.bound_size or ("16M" if args.tiny else "1G"))
    except ValueError as exc:
        p.error(f"--budget/--overhead/--bound_size: {exc}")
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    args.section_list = {s.strip() for s in args.sections.split(",") if s.strip()}
    if bad := [m for m in args.model_list if m not in FULL]:
        p.error(f"--models: unknown {', '.join(bad)} (known: {', '.join(FULL)})")
    if bad := sorted(args.section_list - {"decode", "load"}):
        p.error(f"--sections: unknown {', '.join(bad)}")
    if args.repeats < 1 or args.tokens < 1 or args.rest < 0:
        p.error("--repeats and --tokens must be >= 1, --rest >= 0")
    if args.cgroup and (why := MemoryCgroup.available()):
        p.error(f"{why}; --no_cgroup runs without limits")
    return args


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    started = time.time()
    from deepnvme._core.op import aio_module, pin_memory_module

    # Built here, outside any cgroup and clock: a JIT build inside a child would be charged to its limit.
    aio_module()
    pin_memory_module()
    specs = TINY if args.tiny else FULL
    models: dict[str, Model] = {}
    for name in args.model_list:
        spec = specs[name]
        d = build_model(spec, workdir, log)
        total, blocks = tensor_bytes(d, spec.blocks)
        store = build_store(d, workdir, log) if "decode" in args.section_list else None
        models[name] = Model(spec, d, store, workdir / f"offload-{d.name}", total, blocks)
    built = time.time() - started
    if args.build_only:
        log(f"built in {built:.0f} s: " + ", ".join(f"{m.dir} ({m.total_bytes / 1e6:,.0f} MB)"
                                                   for m in models.values()))
        return 0
    notes = [f"Building took {built:.0f} s (models are reused from --workdir while their configuration is "
             "the same; deepnvme's store while deepnvme.offload's sources are too)."]
    bound = DriveBound(workdir, args.bound_size) if "decode" in args.section_list else None
    load = None
    if "load" in args.section_list:
        dense_dir = models["dense"].dir if "dense" in models else build_model(specs["dense"], workdir, log)
        load = LoadSection(checkpoint_files(dense_dir))
    heats: list[list[Run]] = []
    if "decode" in args.section_list:
        for m in models.values():
            heat = [Run(m, c, lambda m=m, c=c: run_child(args, m, c, log))
                    for c in CONTENDERS]
            heat.append(Run(m, "drive", bound.measure))
            heats.append(heat)
    if load is not None:
        heats.append(load.runs())
    load_before = load_average()
    notes += [] if "decode" not in args.section_list else [
        "Page cache: every data file of the contender (checkpoint, store, offload folder) is flushed and "
        "dropped (fdatasync + POSIX_FADV_DONTNEED) before its process starts and again before each batch "
        "size; the pages still cached afterwards are in the JSON (pages_left_cached).",
        "accelerate's max_memory for the CPU is the budget plus the bytes deepnvme keeps resident outside "
        "the blocks, so both hold the same weight bytes in memory; its device_map is in the JSON.",
        "The MoE's I/O bound divides by the bytes deepnvme-store read per step (routed experts, after its "
        "expert cache); the dense model's by every block's bytes.",
        "The MoE's limits at batch 1: deepnvme-store's demand reads of the timed steps (each layer's misses, "
        "in order) replayed by the raw handle alone at each of the drive bound's settings, the fastest pass "
        "kept, after the decode, in the same process; a layer's experts are known only once its router has "
        "run on the layer before's output, so without guessing no reader can do better than those reads in "
        "series, and with this CPU's compute in between, than the two in series. The limits are generous: "
        "the replay reads blobs the decode read seconds before (the host may still cache them), leaves out "
        "the dense units' reads and every CRC, and is credited with all the bytes deepnvme-store read. A run "
        "whose replay is missing says why in the JSON (routed_replay.error).",
    ]

    def write(done: int) -> None:
        """The report and JSON of every sample so far (rewritten after each repeat: a run stopped early
        keeps what it measured)."""
        best = bound.best()[0] if bound is not None and bound.samples else 0.0
        analyses = [analyse(m, best) for m in models.values() if m.samples]
        load_summary = load.summary() if load is not None else None
        took = [f"{done} of {args.repeats} repeats done; measuring took "
                f"{time.time() - started - built:.0f} s; {time.time() - started:.0f} s in all."]
        meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "argv": sys.argv[1:] if argv is None else argv,
                "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.release()}",
                "workdir": str(workdir), "load_before": load_before, "load_after": load_average(),
                "note": args.note, "cgroup": args.cgroup, "budget": args.budget, "overhead": args.overhead,
                "expert_lookahead": args.expert_lookahead,
                "repeats": done, "tokens": args.tokens, "quick": args.quick, "tiny": args.tiny,
                "notes": notes + took}
        text = render(analyses, models, bound, load_summary, meta)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text)
        out.with_suffix(".json").write_text(json.dumps(
            {"meta": meta, "analyses": analyses, "load": load_summary,
             "drive": bound.samples if bound is not None else None,
             "samples": {n: m.samples for n, m in models.items()}}, indent=1, default=str))
        if done == args.repeats:
            print(text)
        log(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')} ({done} repeat(s))")

    try:
        last = 0
        for r, i, run in interleave(heats, args.repeats):
            if r != last:
                write(r)
                last = r
            which = f"{run.model.spec.name} {run.name}" if run.model else run.name
            log(f"repeat {r + 1}/{args.repeats} [{i + 1}/{len(heats)}] {which} "
                f"at {time.time() - started:.0f} s")
            time.sleep(args.rest)
            got = run.fn()
            if run.model is not None and run.name != "drive":
                got["repeat"] = r
                run.model.samples.setdefault(run.name, []).append(got)
                for x in got.get("runs", []):
                    log(f"    batch {x['batch']}: {x['tokens_per_s']:.2f} tokens/s")
    finally:
        if bound is not None:
            bound.close()
        for m in models.values():
            shutil.rmtree(m.offload, ignore_errors=True)
    write(args.repeats)
    return 0

if __name__ == "__main__":
    sys.exit(main())
