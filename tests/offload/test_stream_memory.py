"""A streamed model four times the budget runs inside a memory cgroup (v1) of the budget plus a fixed
overhead, where the same model in memory could not: page cache counts there, so reads must bypass it.

The group limits what the child allocates after joining it (cgroup v1 leaves the charges of pages a
process already had with its old group): the interpreter, torch and transformers are loaded before,
and the limit is budget + OVERHEAD for the pool, the tensors outside units (embeddings, head), the
activations and any page cache. Skipped where memory cgroups v1 cannot be made (no /sys/fs/cgroup/memory,
not root); the group is removed afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cgroups import memory_cgroup

from tests.offload.stream_models import PROMPT, require_hf

require_hf()

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 28 << 20
# Beside the pool: embeddings and head (2 MiB here), activations and KV cache, allocator slack.
OVERHEAD = 48 << 20


@pytest.fixture
def group() -> Iterator[Path]:
    with memory_cgroup(f"deepnvme-stream-{os.getpid()}", BUDGET + OVERHEAD) as path:
        yield path


@pytest.mark.parametrize("how", ["meta", "one_call"])
def test_model_4x_the_budget_runs_in_a_cgroup_of_budget_plus_overhead(group: Path, tmp_path: Path,
                                                                      how: str) -> None:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GPT2Config(n_layer=10, n_embd=512, n_head=8, vocab_size=1000, n_positions=64, bos_token_id=0,
                           eos_token_id=0)
    model = tf.GPT2LMHeadModel(config).eval()
    with torch.inference_mode():
        want = model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False).tolist()
    model.save_pretrained(tmp_path / "model", safe_serialization=True)
    block_bytes = sum(p.numel() * 4 for p in model.transformer.h.parameters())
    del model
    assert block_bytes >= 4 * BUDGET and block_bytes > BUDGET + OVERHEAD
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.offload.stream_memory_child", str(tmp_path / "model"),
                           str(BUDGET), str(group), how], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=240)
    killed = "killed by the memory cgroup (OOM)" if done.returncode == -9 else ""
    assert done.returncode == 0, f"{killed} rc={done.returncode}\n{done.stderr[-3000:]}"
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["tokens"] == want
    assert r["streamed_bytes"] == block_bytes and r["bytes_read"] >= 8 * block_bytes
    assert r["group_peak"] <= BUDGET + OVERHEAD
    print(f"streamed {block_bytes >> 20} MiB of blocks through a {BUDGET >> 20} MiB budget in a cgroup of "
          f"{(BUDGET + OVERHEAD) >> 20} MiB: group peak {r['group_peak'] >> 20} MiB, process peak RSS "
          f"{r['peak_rss'] >> 20} MiB (interpreter and libraries included, loaded before joining)")


@pytest.mark.parametrize("kind", ["gpt2", "mixtral", "moe_gpt"])
def test_streaming_a_model_in_memory_frees_its_blocks_and_experts(kind: str, tmp_path: Path) -> None:
    """stream_weights on a model loaded in memory (real weights, not meta) gives back the memory of every
    block and every expert: RSS after is RSS before less what streams, plus the budget (the locked pool)
    and a little slack. Measured in a child process so that the RSS is the model's alone."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.offload.stream_freed_child", kind, str(tmp_path),
                           str(16 << 20)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert r["equal"]
    assert r["streamed"] >= 0.9 * r["total"] and r["streamed"] + r["resident"] >= r["total"]
    assert r["streamed"] >= 100 << 20  # large enough for the allocator to give it back to the system
    slack = 24 << 20  # the streamer's own structures, allocator rounding
    assert r["after"] <= r["before"] - r["streamed"] + r["budget"] + slack, (
        f"RSS {r['before'] >> 20} MiB before streaming, {r['after'] >> 20} MiB after; {r['streamed'] >> 20} "
        f"MiB streamed, budget {r['budget'] >> 20} MiB")
