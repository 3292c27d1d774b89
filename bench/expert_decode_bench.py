#!/usr/bin/env python3
"""Decoding a streamed MoE at batch 8 and 16 once its experts are in memory: a layer's routed experts
computed one after another against computed together, interleaved, one run.

    python3 bench/expert_decode_bench.py [--workdir /work/benchtmp/expert_decode] [--repeats 3]
                                         [--tokens 8] [--tiny] [--out bench/results/expert_decode]

Two models with random weights, built here and kept under --workdir, each streamed by
``deepnvme.offload.stream_weights`` with a budget that holds all of its experts (so after the first pass
nothing is read: what is timed is the experts' compute as the streamed model does it):

- hf: a Mixtral-style ``MixtralForCausalLM`` (hidden 768, expert width 1536, 8 experts of which 2 per
  token, 4 layers); "before" is transformers' ``eager`` experts (a loop over the routed experts), "after"
  its ``grouped_mm`` (the default), the routed experts handed over as views of the expert cache;
- moe_gpt: the deepnvme.moe recipe's GPT (hidden 768, 8 experts in every block, top-2, 4 blocks, no KV
  cache: each step runs the whole sequence); "before" ``DEEPNVME_MOE_EXPERTS=loop``, "after" the default
  (deepnvme.moe.grouped's choice: segments on the CPU).

Each contender is a process of its own (``--child``), one torch thread, the same prompt; a warm-up pass
reads every expert into the cache; then ``--tokens`` greedy steps are timed. Every contender must decode
the tokens the same model decodes in memory with the same experts path. Reported: tokens/s median
(min-max) and the ratio after / before per model and batch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _harness import ROOT, greedy_steps, interleave, median_range, spread  # first: this checkout on sys.path

BATCHES = (8, 16)
PATHS = {"hf": ("eager", "grouped_mm"), "moe_gpt": ("loop", "auto")}


def build(kind: str, tiny: bool) -> Any:
    import torch

    torch.manual_seed(0)
    h, w, layers = (64, 128, 2) if tiny else (768, 1536, 4)
    if kind == "hf":
        import transformers as tf

        return tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=512, hidden_size=h, intermediate_size=w, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)).eval()
    from deepnvme.moe.recipe.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=512, seq_length=256, num_layers=layers, hidden_size=h, num_attention_heads=8,
                    ffn_hidden_size=w, num_experts=(8,), expert_interval=1, topk=2)
    return GPT(cfg, seed=0).eval()


def store_of(kind: str, workdir: Path, tiny: bool) -> Path:
    from deepnvme.offload import write_store

    out = workdir / f"{kind}{'-tiny' if tiny else ''}"
    if not (out / "done").is_file():
        write_store(build(kind, tiny), out)
        (out / "done").write_text("")
    return out


def decode(model: Any, kind: str, batch: int, tokens: int) -> tuple[list[float], list[list[int]]]:
    """Greedy steps from a fixed prompt: (seconds of each timed step, the tokens)."""
    import torch

    ids = torch.randint(0, 512, (batch, 16), generator=torch.Generator().manual_seed(batch))
    steps: list[float] = []
    with torch.inference_mode():
        if kind == "hf":
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            steps, made = greedy_steps(model, nxt, out.cache, tokens)
            return steps, torch.cat([nxt, *made], 1).tolist()
        seq = torch.cat([ids, model(ids)[0][:, -1].argmax(-1, keepdim=True)], 1)
        for _ in range(tokens):
            t0 = time.perf_counter()
            nxt = model(seq)[0][:, -1].argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - t0)
            seq = torch.cat([seq, nxt], 1)
        return steps, seq[:, 16:].tolist()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    kind, path = spec["kind"], spec["path"]
    if kind == "moe_gpt" and path == "loop":
        os.environ["DEEPNVME_MOE_EXPERTS"] = "loop"
    model = build(kind, spec["tiny"])
    if kind == "hf":
        model.set_experts_implementation(path)
    out: dict[str, Any] = {"runs": {}}
    want = {b: decode(model, kind, b, spec["tokens"])[1] for b in BATCHES}  # in memory, same path
    if spec["streamed"]:
        from accelerate import init_empty_weights

        from deepnvme.offload import stats, stream_weights

        if kind == "hf":
            with init_empty_weights():
                model = type(model)(model.config).eval()
            model.set_experts_implementation(path)
        store = Path(spec["store"])
        stream_weights(model, store, sum(f.stat().st_size for f in store.iterdir()) + (64 << 20))
        decode(model, kind, BATCHES[-1], 1)  # every expert into the cache
    for b in BATCHES:
        steps, got = decode(model, kind, b, spec["tokens"])
        out["runs"][str(b)] = {"tokens_per_s": b * len(steps) / sum(steps), "same_tokens": got == want[b]}
    if spec["streamed"]:
        e = stats(model)["experts"]
        out["expert_misses"] = e["misses"]
        out["last_path"] = next((getattr(m, "last_path", None) for m in model.modules()
                                 if getattr(m, "last_path", None)), None)
    return out


def render(samples: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> str:
    """The Markdown report: per model and batch, tokens/s before and after and their ratio."""
    lines = [f"# Streamed MoE decode, experts in memory: one by one against together "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}{', --tiny' if args.tiny else ''})", "",
             f"Command: `python3 bench/expert_decode_bench.py {' '.join(sys.argv[1:])}`", "",
             f"{args.repeats} interleaved repeats, {args.tokens} timed greedy steps, one torch thread, every "
             "expert cached before timing. Tokens/s: median (min–max).", "",
             "| model | batch | before (one by one) | after (together) | after / before | same tokens as "
             "in memory |", "|---|---|---|---|---|---|"]
    for kind, (before, after) in PATHS.items():
        for b in BATCHES:
            runs = {path: [s["runs"][str(b)] for s in samples[kind][path]] for path in (before, after)}
            tps = {path: [r["tokens_per_s"] for r in rs] for path, rs in runs.items()}
            same = all(r["same_tokens"] for rs in runs.values() for r in rs)
            ratio = spread(tps[after])["median"] / spread(tps[before])["median"]
            lines.append(f"| {kind} | {b} | {before}: {median_range(tps[before])} | {after}: "
                         f"{median_range(tps[after])} | {ratio:.2f} | {'yes' if same else 'NO'} |")
    paths = [f"{k} {p}: {s[0]['last_path']}" for k, v in samples.items() for p, s in v.items()
             if s[0].get("last_path")]
    lines += ["", "deepnvme.moe's path in the last step: " + "; ".join(paths), ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="/work/benchtmp/expert_decode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="tiny models, to show the bench works")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "expert_decode"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    stores = {k: store_of(k, workdir, args.tiny) for k in PATHS}
    heats = [[(k, path) for path in paths] for k, paths in PATHS.items()]
    samples: dict[str, dict[str, list[dict]]] = {k: {path: [] for path in v} for k, v in PATHS.items()}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for r, _, (kind, path) in interleave(heats, args.repeats):
        spec = {"kind": kind, "path": path, "tiny": args.tiny, "tokens": args.tokens, "streamed": True,
                "store": str(stores[kind])}
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                              text=True, env=env, timeout=900, check=False)
        line = next((x for x in proc.stdout.splitlines()[::-1] if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            raise SystemExit(f"{kind} {path} failed:\n{proc.stderr[-3000:]}")
        samples[kind][path].append(json.loads(line[7:]))
        print(f"repeat {r + 1}/{args.repeats} {kind} {path}", file=sys.stderr, flush=True)
    report = render(samples, args)
    print(report)
    Path(args.out).with_suffix(".md").write_text(report)
    Path(args.out).with_suffix(".json").write_text(json.dumps(samples, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
