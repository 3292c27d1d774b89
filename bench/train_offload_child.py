#!/usr/bin/env python3
"""One contender of bench/train_offload_bench.py in a process of its own: a Llama-like model built locally,
trained a few steps (forward + backward + AdamW), each timed step reported.

    python3 bench/train_offload_child.py '<json spec>'        # memory, offload, prepare
    /work/dsvenv/bin/python bench/train_offload_child.py '<json spec>'   # deepspeed

The spec (written by the bench) names the contender, the model's shape, batch, sequence length, warm-up and
timed steps, and the directories. Contenders:
- prepare:   build the model (seed 0) and write it to deepnvme's store (write_store), for offload;
- memory:    the model and torch.optim.AdamW in memory;
- offload:   deepnvme.offload.offload_parameters + OffloadedOptimizer(AdamW); the model is built without
             weights (accelerate's init_empty_weights) and filled from the store, so the process never
             holds it whole (spec "build": "checkpoint"), or built in memory and then offloaded ("memory");
- deepspeed: DeepSpeed ZeRO-3 with offload_param and offload_optimizer on NVMe, torch.optim.AdamW as the
             client optimizer, world size 1, gloo, DS_ACCELERATOR=cpu (runs under DeepSpeed's venv; this
             file imports neither deepnvme nor _harness at module level, so it runs there).
Every contender starts from the same weights (seed 0) and sees the same batches (seeded by step), so their
losses can be compared; memory and offload must agree bit for bit.

Per timed step: wall seconds, this process's CPU seconds (all threads, user+system), bytes the process read
from and wrote to the drive (/proc/self/io read_bytes/write_bytes: O_DIRECT I/O included), and for offload
the bytes its own counters say it moved (off.stats() deltas + opt.last_step). Memory: VmHWM before the timed
steps (building, loading, warm-up) and during them (VmHWM reset after warm-up, /proc/self/clear_refs), and
VmLck. The last stdout line is ``RESULT <json>``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch loads libgomp (see offload_bench.py)

import torch  # noqa: E402
import transformers as tf  # noqa: E402

#: Model shapes of --size: hidden, intermediate, layers, heads, kv heads, vocabulary.
SIZES: dict[str, dict[str, int]] = {
    # 40.5 M parameters, 162 MB fp32 (33 MB of it embeddings and head, resident)
    "small": {"hidden": 512, "intermediate": 1408, "layers": 10, "heads": 8, "kv_heads": 8, "vocab": 8192},
    # 110 M parameters, 438 MB fp32
    "medium": {"hidden": 768, "intermediate": 2048, "layers": 12, "heads": 12, "kv_heads": 12,
               "vocab": 16000},
    # 374 M parameters, 1.50 GB fp32 (262 MB of it embeddings and head, resident)
    "1.5g": {"hidden": 1024, "intermediate": 2816, "layers": 24, "heads": 16, "kv_heads": 16, "vocab": 32000},
}


def llama_config(shape: dict[str, int], seq: int) -> tf.LlamaConfig:
    """The bench's LlamaConfig of `shape` (a SIZES entry), fp32, untied head, eager attention."""
    return tf.LlamaConfig(hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                          num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                          num_key_value_heads=shape["kv_heads"], vocab_size=shape["vocab"],
                          max_position_embeddings=max(2048, seq), tie_word_embeddings=False,
                          attn_implementation="eager", use_cache=False)


def build_model(config: tf.LlamaConfig) -> torch.nn.Module:
    """The model with its weights made in memory, seed 0: every contender starts from these."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    model.train()
    return model


def checkpointing(model: torch.nn.Module, spec: dict[str, Any]) -> torch.nn.Module:
    """Activation checkpointing of every block (transformers' own, not reentrant) when the spec asks:
    the same for every contender."""
    if spec.get("checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def units_of(model: torch.nn.Module, spec: dict[str, Any]) -> list[torch.nn.Module] | None:
    """offload_parameters' units: the blocks (None: its default), and the embeddings and the head as
    units of their own when the spec asks."""
    if not spec.get("offload_embeddings"):
        return None
    return [model.model.embed_tokens, *model.model.layers, model.lm_head]


def batch_ids(step: int, batch: int, seq: int, vocab: int, rank: int = 0) -> torch.Tensor:
    """Step `step`'s token ids on rank `rank`: the same for every contender."""
    seed = 1000 + step + 100_000 * rank
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def init_ranks(spec: dict[str, Any]) -> None:
    """Join the gloo group of spec["world"] ranks (the bench sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2: fully_shard on the embeddings, each decoder block and the head (units of their own, as
    offload_parameters' with --offload_embeddings), then on the model (its final norm)."""
    from torch.distributed.fsdp import fully_shard

    for unit in (model.model.embed_tokens, *model.model.layers, model.lm_head):
        fully_shard(unit)
    fully_shard(model)
    return model


def proc_io() -> tuple[int, int]:
    """Bytes this process (all its threads, exited ones too) has read from and written to storage."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def status(*keys: str) -> dict[str, int]:
    """Fields of /proc/self/status given in kB, in bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"^{k}:\s+(\d+)", text, re.M).group(1)) * 1024 for k in keys}  # type: ignore


def mark(text: str) -> None:
    """Progress on stderr with the resident size: where a child killed by its cgroup had got to."""
    rss = status("VmRSS")["VmRSS"] >> 20
    print(f"[{time.strftime('%H:%M:%S')}] {text}: VmRSS {rss} MiB", file=sys.stderr, flush=True)


def reset_peak() -> None:
    """VmHWM := VmRSS, so that the next VmHWM is the peak of what runs from now on."""
    Path("/proc/self/clear_refs").write_text("5")


class Contender:
    """A model and its optimizer, stepped by `step`; `moved` says what its own counters moved (None if it
    has none)."""

    locked_budget = 0  # bytes of locked memory the contender was given (0: none asked for)
    fb_s = 0.0  # seconds of the last step's forward + backward (the rest: optimizer step and zero_grad)

    def step(self, ids: torch.Tensor) -> float:
        raise NotImplementedError

    def moved(self) -> tuple[int, int] | None:
        return None

    def extra(self) -> dict[str, Any]:
        """Counters of the last step to report beside it."""
        return {}

    def close(self) -> None:
        pass


class Memory(Contender):
    def __init__(self, spec: dict[str, Any], config: tf.LlamaConfig) -> None:
        self.model = checkpointing(build_model(config), spec)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=spec["lr"])

    def step(self, ids: torch.Tensor) -> float:
        t = time.perf_counter()
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.fb_s = time.perf_counter() - t
        self.opt.step()
        self.opt.zero_grad()
        return float(loss)


class Offload(Contender):
    def __init__(self, spec: dict[str, Any], config: tf.LlamaConfig) -> None:
        sys.path.insert(0, spec["root"])  # this checkout's deepnvme
        from deepnvme.offload import OffloadedOptimizer
        from deepnvme.offload.train import offload_parameters

        work = spec["swap_dir"]
        budget = spec["budget"]
        if spec["build"] == "checkpoint":
            import accelerate

            with accelerate.init_empty_weights():
                self.model = tf.LlamaForCausalLM(config)
            self.model.tie_weights()
            checkpointing(self.model.train(), spec)
            mark("built without weights")
            self.off = offload_parameters(self.model, work, budget, units=units_of(self.model, spec),
                                          checkpoint=spec["store"])
        else:
            self.model = checkpointing(build_model(config), spec)
            self.off = offload_parameters(self.model, work, budget, units=units_of(self.model, spec))
        mark("offload_parameters done")
        self.opt = OffloadedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=spec["lr"]), work,
                                      spec["opt_budget"],
                                      step_in_backward=spec.get("step_in_backward", False))
        mark("OffloadedOptimizer made")
        self.locked_budget = self.off.budget_bytes + spec["opt_budget"]
        self.last: tuple[int, int] = (0, 0)

    def step(self, ids: torch.Tensor) -> float:
        before = self.off.stats()
        t = time.perf_counter()
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.fb_s = time.perf_counter() - t
        mid = self.off.stats()
        self.opt.step()
        self.opt.zero_grad()
        after, prof = self.off.stats(), self.opt.last_step
        read = after["bytes_read"] - before["bytes_read"] + (prof.bytes_read if prof else 0)
        written = after["bytes_written"] - before["bytes_written"] + (prof.bytes_written if prof else 0)
        self.last = (read, written)
        self.stats = after
        # offload_shards counts no reads ahead and demanded apart
        self.counts = {k: after[k] - before[k] for k in ("unit_reads", "prefetched", "demanded")
                       if k in after}
        self.counts["read_wait_s"] = prof.read_wait_s if prof else None
        self.counts["fb_read"] = mid["bytes_read"] - before["bytes_read"]
        self.counts["fb_written"] = mid["bytes_written"] - before["bytes_written"]
        return float(loss)

    def extra(self) -> dict[str, Any]:
        return self.counts

    def moved(self) -> tuple[int, int] | None:
        return self.last

    def close(self) -> None:
        self.opt.close()
        self.off.close(restore=False)  # the model would not fit in the cgroup: its values are dropped


class FsdpMemory(Memory):
    """Several ranks: FSDP2 in memory (fully_shard) and torch.optim.AdamW over its shards."""

    def __init__(self, spec: dict[str, Any], config: tf.LlamaConfig) -> None:
        init_ranks(spec)
        self.model = shard(checkpointing(build_model(config), spec))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=spec["lr"])

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


class FsdpOffload(Offload):
    """Several ranks: FSDP2 with each rank's shards on its drive (offload_shards) and AdamW's state beside
    them (OffloadedOptimizer); the model built on the meta device and its shards made from the store."""

    def __init__(self, spec: dict[str, Any], config: tf.LlamaConfig) -> None:
        sys.path.insert(0, spec["root"])
        import accelerate

        from deepnvme.offload import OffloadedOptimizer, offload_shards

        init_ranks(spec)
        with accelerate.init_empty_weights():
            self.model = tf.LlamaForCausalLM(config)
        shard(checkpointing(self.model.train(), spec))
        mark("built without weights, sharded")
        work = os.path.join(spec["swap_dir"], f"rank{os.environ['RANK']}")
        self.off = offload_shards(self.model, work, spec["budget"], checkpoint=spec["store"])
        mark("offload_shards done")
        self.opt = OffloadedOptimizer(torch.optim.AdamW(self.model.parameters(), lr=spec["lr"]), work,
                                      spec["opt_budget"],
                                      step_in_backward=spec.get("step_in_backward", False))
        self.locked_budget = self.off.budget_bytes + spec["opt_budget"]
        self.last = (0, 0)

    def close(self) -> None:
        import torch.distributed as dist

        super().close()
        dist.destroy_process_group()


class DeepSpeed(Contender):
    def __init__(self, spec: dict[str, Any], config: tf.LlamaConfig) -> None:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
                     "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
            os.environ.setdefault(k, v)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        model = checkpointing(build_model(config), spec)
        nvme = spec["swap_dir"]
        os.makedirs(nvme, exist_ok=True)
        largest = max(p.numel() for p in model.parameters())
        block = sum(p.numel() for p in model.model.layers[0].parameters())
        zero: dict[str, Any] = {
            "stage": 3,
            # buffer_size must hold the largest parameter (the embedding); DeepSpeed's default buffer_count
            # Each parameter fetched takes one buffer of buffer_size elements (at least the largest, the
            # embedding); buffer_count must cover every parameter live at once (ds_buffer_count).
            "offload_param": {"device": "nvme", "nvme_path": nvme,
                              "buffer_count": spec.get("ds_buffer_count", 16), "buffer_size": largest,
                              # DeepSpeed's default (1e9 elements) copies up to that many parameter elements
                              # "permanently to CPU" at initialize: every model under 1e9 parameters would
                              # never read a parameter from the drive. 0: all of them on the drive.
                              "max_in_cpu": spec.get("ds_max_in_cpu", 0)},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pipeline_read": True,
                                  "pipeline_write": True},
        }
        # Release a block's parameters when it is done (DeepSpeed's defaults of 1e9 keep every parameter of
        # a smaller model live after its first fetch, which with them on the drive runs out of buffers):
        # at most two blocks live, prefetch one block ahead; spec["ds_zero"] overrides.
        zero.update({"stage3_max_live_parameters": 2 * block, "stage3_max_reuse_distance": 0,
                     "stage3_prefetch_bucket_size": block})
        for key in ("sub_group_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            if spec.get("ds_zero", {}).get(key) is not None:
                zero[key] = spec["ds_zero"][key]
        ds_config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
            "zero_force_ds_cpu_optimizer": False,  # torch's AdamW, as the other contenders
            "zero_optimization": zero, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        }
        if spec.get("ds_aio"):
            ds_config["aio"] = spec["ds_aio"]
        self.ds_config = ds_config
        # Converted here with zero.Init(module=...) and this config rather than inside initialize():
        # initialize() converts an unpartitioned model with Init(dtype=<the model's dtype>), and
        # Init._set_dtype's `dtype or torch.float16 if is_fp16_supported() else torch.bfloat16 ...` makes
        # that bf16 on the CPU accelerator (fp16 unsupported): fp32 parameters silently trained in bf16.
        deepspeed.zero.Init(module=model, config_dict_or_path=ds_config, remote_device="nvme")
        dtype = next(model.parameters()).dtype
        if dtype != torch.float32:
            raise RuntimeError(f"DeepSpeed made the parameters {dtype}, not float32")
        opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        self.deepspeed_version = deepspeed.__version__

    def step(self, ids: torch.Tensor) -> float:
        t = time.perf_counter()
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.fb_s = time.perf_counter() - t
        self.engine.step()
        return float(loss)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


CONTENDERS = {"memory": Memory, "offload": Offload, "deepspeed": DeepSpeed}
#: With several ranks (spec "world" > 1): FSDP2 in memory and FSDP2 offloaded; DeepSpeed on the same ranks.
RANKED = {"memory": FsdpMemory, "offload": FsdpOffload, "deepspeed": DeepSpeed}


def prepare(spec: dict[str, Any], config: tf.LlamaConfig) -> dict[str, Any]:
    """Write the model (seed 0) to deepnvme's store at spec["store"], for the offload contender."""
    sys.path.insert(0, spec["root"])
    from deepnvme.offload import write_store

    model = build_model(config)
    t0 = time.perf_counter()
    write_store(model, spec["store"])
    return {"params": sum(p.numel() for p in model.parameters()),
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "block_param_bytes": sum(p.numel() * p.element_size() for p in model.model.layers.parameters()),
            "write_s": time.perf_counter() - t0}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    config = llama_config(spec["shape"], spec["seq"])
    import_rss = status("VmRSS")["VmRSS"]  # the interpreter with torch and transformers, before any model
    if spec["contender"] == "prepare":
        return prepare(spec, config)
    t0 = time.perf_counter()
    world = spec.get("world", 1)
    rank = int(os.environ.get("RANK", "0")) if world > 1 else 0
    contender = (RANKED if world > 1 else CONTENDERS)[spec["contender"]](spec, config)
    setup_s = time.perf_counter() - t0
    vocab, batch, seq = spec["shape"]["vocab"], spec["batch"], spec["seq"]
    losses: list[float] = []
    mark(f"{spec['contender']} set up")
    for i in range(spec["warmup"]):
        losses.append(contender.step(batch_ids(i, batch, seq, vocab, rank)))
        mark(f"warm-up step {i} done")
    setup_peak = status("VmHWM")["VmHWM"]
    reset_peak()
    steps = []
    for i in range(spec["warmup"], spec["warmup"] + spec["steps"]):
        ids = batch_ids(i, batch, seq, vocab, rank)
        io0, c0, t = proc_io(), time.process_time(), time.perf_counter()
        loss = contender.step(ids)
        wall, cpu, io1 = time.perf_counter() - t, time.process_time() - c0, proc_io()
        losses.append(loss)
        own = contender.moved()
        steps.append({"s": wall, "fb_s": contender.fb_s, "cpu_s": cpu, "io_read": io1[0] - io0[0],
                      "io_written": io1[1] - io0[1], "own_read": own[0] if own else None,
                      "own_written": own[1] if own else None, **contender.extra()})
        print(f"step {i} {wall:.3f} s loss {loss:.6f}", file=sys.stderr, flush=True)
    st = status("VmHWM", "VmRSS", "VmLck")
    out: dict[str, Any] = {"contender": spec["contender"], "setup_s": setup_s, "steps": steps,
                           "losses": losses, "import_rss": import_rss,
                           "setup_peak_rss": setup_peak, "step_peak_rss": st["VmHWM"],
                           "peak_rss": max(setup_peak, st["VmHWM"]), "locked": st["VmLck"],
                           "locked_budget": contender.locked_budget, "threads": torch.get_num_threads(),
                           "torch": torch.__version__}
    if isinstance(contender, Offload):
        out["offload_stats"] = contender.stats
    out["rank"] = rank
    if isinstance(contender, DeepSpeed):
        out["deepspeed"] = contender.deepspeed_version
        out["ds_config"] = contender.ds_config
    contender.close()
    return out


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        out = run(spec)
    except BaseException as exc:  # reported to the bench as this contender's failure
        traceback.print_exc()
        print("ERROR " + f"{type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
        return 1
    finally:
        if spec.get("contender") == "deepspeed":
            shutil.rmtree(spec["swap_dir"], ignore_errors=True)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
