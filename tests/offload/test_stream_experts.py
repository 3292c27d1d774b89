"""stream_weights on Mixture-of-Experts models: experts are units of their own, read only when routed to,
through the LRU expert cache; tokens and logits equal the in-memory model's bit for bit, with a budget
smaller than all the experts, for a Mixtral-style Hugging Face model (every store layout of its experts,
every experts implementation of transformers) and a deepnvme.moe GPT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is needed for streaming tests (the offload extra)")
pytest.importorskip("accelerate", reason="accelerate is needed for streaming tests (the offload extra)")
from safetensors.torch import save_file  # noqa: E402

from deepnvme.offload import stats, stream_weights, unstream, write_store  # noqa: E402
from deepnvme.offload.experts import FUSED, MODULES, find_expert_sets  # noqa: E402
from deepnvme.offload.stores import StoreError  # noqa: E402
from tests.offload.stream_models import NEW_TOKENS, PROMPT, generate  # noqa: E402
from tests.support.stream_helpers import damage_blob  # noqa: E402

EXPERT = 3 * 64 * 128 * 4  # one Mixtral expert below: gate, up and down projections in fp32
BUDGET = 400_000  # a few experts: far less than the 24 of the model


def mixtral(impl: str, *, empty: bool = False) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=96, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
    cfg._experts_implementation = impl
    if empty:
        from accelerate import init_empty_weights

        with init_empty_weights():
            return tf.MixtralForCausalLM(cfg).eval()
    torch.manual_seed(0)
    return tf.MixtralForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """refs(impl): the in-memory model with that experts implementation, its output, and its weights in
    each store layout (built once per implementation)."""
    made: dict[str, dict] = {}

    def get(impl: str) -> dict:
        if impl not in made:
            model = mixtral(impl)
            root = tmp_path_factory.mktemp(f"mixtral-{impl}")
            tokens, logits = generate(model)
            model.save_pretrained(root / "per_expert", safe_serialization=True)
            fused = root / "fused"
            fused.mkdir()
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, fused / "model.safetensors")
            made[impl] = {"model": model, "tokens": tokens, "logits": logits,
                          "per_expert": root / "per_expert", "fused": fused,
                          "own": Path(write_store(model, root / "own"))}
        return made[impl]
    return get


@pytest.fixture(scope="module")
def mixtral_ref(refs: Any) -> dict:
    return refs("grouped_mm")


def test_save_pretrained_keeps_experts_apart(mixtral_ref: dict) -> None:
    """What the mapping is for: the model holds 3-D expert tensors, transformers 5.24 saves per-expert ones
    under the old names; deepnvme's store keeps one blob per expert."""
    from safetensors import safe_open

    with safe_open(str(mixtral_ref["per_expert"] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.7.w1.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    sets = find_expert_sets(mixtral_ref["model"])
    assert [(s.name, s.kind, s.num_experts) for s in sets] == [
        (f"model.layers.{i}.mlp.experts", FUSED, 8) for i in range(3)]
    assert tuple(sets[0].module.gate_up_proj.shape) == (8, 256, 64)
    import json

    manifest = json.loads((mixtral_ref["own"] / "manifest.json").read_text())
    blobs = {b["unit"]: b for b in manifest["blobs"]}
    expert = blobs["model.layers.1.mlp.experts.5"]
    assert [t["names"] for t in expert["tensors"]] == [["model.layers.1.mlp.experts.5.gate_up_proj"],
                                                      ["model.layers.1.mlp.experts.5.down_proj"]]
    assert expert["nbytes"] == EXPERT and expert["offset"] % 4096 == 0


@pytest.mark.parametrize(("impl", "where"), [
    ("grouped_mm", "per_expert"), ("grouped_mm", "fused"), ("grouped_mm", "own"), ("eager", "own"),
    ("batched_mm", "fused")])
def test_mixtral_same_tokens_and_logits(refs: Any, impl: str, where: str) -> None:
    """Every store layout of the experts (save_pretrained's per-expert tensors, a fused checkpoint,
    deepnvme's store) and every experts implementation of transformers."""
    mixtral_ref = refs(impl)
    model = stream_weights(mixtral(impl, empty=True), mixtral_ref[where], BUDGET)
    tokens, logits = generate(model)
    assert tokens.shape[1] == PROMPT.shape[1] + NEW_TOKENS
    assert torch.equal(tokens, mixtral_ref["tokens"])
    assert torch.equal(logits, mixtral_ref["logits"])
    e = stats(model)["experts"]
    assert e["experts"] == 24 and e["expert_bytes"] >= 24 * EXPERT
    assert EXPERT <= e["capacity_bytes"] < 24 * EXPERT / 4  # the budget holds a few experts only
    assert e["evictions"] > 0 and e["cached_bytes"] <= e["capacity_bytes"]
    assert e["hits"] + e["misses"] > 0 and 0 <= e["hit_rate"] <= 1
    # Each miss, and each read ahead (the last forward's 40 tokens are expected to use nearly every
    # expert), reads one expert: one request from deepnvme's store; from a checkpoint one per tensor run
    # (a fused checkpoint keeps an expert's two slices apart), each with its page edges.
    parts = {"own": 1, "fused": 2, "per_expert": 3}[where]
    assert e["ahead_reads"] > 0 and e["ahead_reads"] == e["guessed_reads"]
    reads = e["misses"] + e["guessed_reads"]
    assert reads <= e["read_requests"] <= parts * reads
    assert e["read_requests"] == reads or where != "own"
    assert reads * EXPERT <= e["bytes_read"] <= reads * (EXPERT + 2 * parts * 4096)
    assert e["tokens"] == PROMPT.shape[1] + (NEW_TOKENS - 1) + tokens.shape[1]
    assert e["bytes_per_token"] == pytest.approx(e["bytes_read"] / e["tokens"])
    unstream(model)
    assert torch.equal(generate(model)[1], mixtral_ref["logits"])


def routed(model: torch.nn.Module, ids: torch.Tensor) -> set[tuple[int, int]]:
    """(layer, expert) pairs the in-memory model routes `ids` to."""
    out: set[tuple[int, int]] = set()
    hooks = [s.module.register_forward_pre_hook(
        lambda _m, args, i=i: out.update((i, int(e)) for e in args[1].unique()))
        for i, s in enumerate(find_expert_sets(model))]
    with torch.inference_mode():
        model(ids)
    for h in hooks:
        h.remove()
    return out


def test_only_routed_experts_are_read(mixtral_ref: dict) -> None:
    """One forward with room for every expert: exactly the routed experts are read, once each, one request
    each from deepnvme's store."""
    ids = torch.tensor([[5, 17]])
    want = routed(mixtral_ref["model"], ids)
    assert 2 <= len(want) < 24
    model = stream_weights(mixtral("grouped_mm", empty=True), mixtral_ref["own"], 24 * EXPERT + (1 << 20))
    with torch.inference_mode():
        model(ids)
    st = model._deepnvme_stream.experts
    assert set(st.cache.read_order) == want and len(st.cache.read_order) == len(want)
    e = stats(model)["experts"]
    assert e["read_requests"] == len(want) and e["bytes_read"] == len(want) * EXPERT
    assert e["evictions"] == 0 and e["hits"] == 0 and e["misses"] == len(want)
    with torch.inference_mode():
        model(ids)  # the same routes again: all hits, nothing read
    e = stats(model)["experts"]
    assert e["hits"] == len(want) and e["read_requests"] == len(want) and e["hit_rate"] == 0.5
    unstream(model)


@pytest.mark.parametrize(("where", "lookahead", "budget"), [
    ("own", 1, 24 * EXPERT + (1 << 20)), ("per_expert", 2, 24 * EXPERT + (1 << 20)), ("own", 1, BUDGET)])
def test_guessed_experts_change_nothing_and_are_counted(mixtral_ref: dict, where: str, lookahead: int,
                                                        budget: int) -> None:
    """Pre-gating (expert_lookahead): each MoE layer guesses the next layers' experts with their routers and
    reads them ahead. Tokens and logits stay the in-memory model's bit for bit, with room for every expert
    and with room for a few; every guessed byte is in bytes_read and is either used, wasted or pending;
    with room for every expert, guesses are read, some are used, and nothing is read twice."""
    model = stream_weights(mixtral("grouped_mm", empty=True), mixtral_ref[where], budget,
                           expert_lookahead=lookahead)
    tokens, logits = generate(model)
    assert torch.equal(tokens, mixtral_ref["tokens"])
    assert torch.equal(logits, mixtral_ref["logits"])
    e = stats(model)["experts"]
    assert e["lookahead"] == lookahead
    assert e["guesses_used"] + e["guesses_wasted"] <= e["guessed_reads"]
    on_demand = e["bytes_read"] - e["guessed_bytes"]
    used = e["needed_bytes"] - on_demand  # guessed bytes a use found
    assert 0 <= used + e["wasted_bytes"] <= e["guessed_bytes"]  # the rest: guesses not used yet
    order = model._deepnvme_stream.experts.cache.read_order
    if budget > 24 * EXPERT:  # free room: guesses are read, and some are right
        assert e["guessed_reads"] > 0 and e["guesses_used"] > 0 and used > 0
        assert len(order) == len(set(order)) and e["evictions"] == 0
    unstream(model)
    assert torch.equal(generate(model)[1], mixtral_ref["logits"])


BATCH = torch.tensor([[(7 * r + 3 * c) % 96 for c in range(4)] for r in range(16)])  # 16 prompts of 4 tokens


def batch_generate(model: torch.nn.Module, steps: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding of BATCH, `steps` tokens, and the logits of every step (each step's 16 tokens use
    nearly every expert of each layer)."""
    with torch.inference_mode():
        out = model.generate(BATCH, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def test_expected_share() -> None:
    from deepnvme.offload.experts import FULL_USE, expected_share

    assert expected_share(1, 2, 8) == pytest.approx(0.25)
    assert expected_share(16, 2, 8) == pytest.approx(1 - 0.75 ** 16) and expected_share(16, 2, 8) > FULL_USE
    assert expected_share(8, 2, 8) < FULL_USE < expected_share(9, 2, 8)
    assert expected_share(3, 8, 8) == 1.0
    assert expected_share(0, 2, 8) == 0.0 and expected_share(4, 0, 8) == 0.0


@pytest.mark.parametrize(("where", "budget"), [("own", BUDGET), ("per_expert", BUDGET),
                                                ("own", 24 * EXPERT + (1 << 20))])
def test_read_ahead_at_full_use_changes_nothing_and_is_counted(mixtral_ref: dict, where: str,
                                                               budget: int) -> None:
    """A batch of 16 sequences: each layer's tokens are expected to use nearly all its experts, so the next
    layers' experts are read ahead in order. Tokens and logits stay the in-memory model's bit for bit; every
    read ahead is counted as a guess, used or wasted; the cache stays inside its part of the budget; with
    room for every expert nothing is read twice."""
    want_tokens, want_logits = batch_generate(mixtral_ref["model"])
    model = stream_weights(mixtral("grouped_mm", empty=True), mixtral_ref[where], budget)
    tokens, logits = batch_generate(model)
    assert torch.equal(tokens, want_tokens)
    assert torch.equal(logits, want_logits)
    st = stats(model)
    e = st["experts"]
    assert e["read_ahead"] and e["lookahead"] == 0
    assert e["ahead_reads"] > 0 and e["ahead_reads"] == e["guessed_reads"]
    assert e["guesses_used"] > 0 and e["guesses_used"] + e["guesses_wasted"] <= e["guessed_reads"]
    on_demand = e["bytes_read"] - e["guessed_bytes"]
    used = e["needed_bytes"] - on_demand
    assert 0 < used and used + e["wasted_bytes"] <= e["guessed_bytes"]
    cache = model._deepnvme_stream.experts.cache
    assert cache.pool.peak_in_use <= cache.pool.capacity == e["capacity_bytes"]
    assert e["capacity_bytes"] + st["budget_bytes"] <= budget
    if budget > 24 * EXPERT:
        order = cache.read_order
        assert len(order) == len(set(order)) == 24 and e["evictions"] == 0 and e["guesses_wasted"] == 0
    else:
        assert e["evictions"] > 0
    unstream(model)


def test_no_read_ahead_for_one_token_or_without_prefetch(mixtral_ref: dict) -> None:
    """Decoding one sequence a token at a time (2 of 8 experts expected used per layer) reads only the
    routed experts, as before; prefetch=False reads nothing ahead even for a batch."""
    model = stream_weights(mixtral("grouped_mm", empty=True), mixtral_ref["own"], BUDGET)
    ids = PROMPT[:, :4]  # 4 tokens: about 0.68 of the experts expected used, under FULL_USE
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        for _ in range(4):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, cache=out.cache, use_cache=True)
    e = stats(model)["experts"]
    assert e["ahead_reads"] == 0 and e["guessed_reads"] == 0 and e["read_requests"] == e["misses"]
    unstream(model)
    model = stream_weights(mixtral("grouped_mm", empty=True), mixtral_ref["own"], BUDGET, prefetch=False)
    tokens, logits = batch_generate(model, steps=2)
    want_tokens, want_logits = batch_generate(mixtral_ref["model"], steps=2)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    e = stats(model)["experts"]
    assert not e["read_ahead"] and e["ahead_reads"] == 0 and e["read_requests"] == e["misses"]
    unstream(model)


@pytest.mark.parametrize("impl", ["grouped_mm", "eager", "batched_mm"])
def test_one_token_gets_its_experts_as_views_in_pool_order(refs: Any, impl: str) -> None:
    """One token routed to two experts that lie in the cache the other way round (the higher id at the
    lower address): they are handed over as one view in pool order, not copied, and the output is the
    in-memory experts' bit for bit with every experts implementation; two tokens still get them in id
    order (copied here)."""
    ref = refs(impl)
    model = stream_weights(mixtral(impl, empty=True), ref["own"], BUDGET)
    experts = model._deepnvme_stream.experts
    cache = experts.cache
    for key in [(0, 5), (0, 1)]:  # 5 first: it takes the start of the empty pool, 1 goes after it
        cache.request([key])
        cache.acquire(key)
        cache.release(key)
    assert cache._entries[(0, 5)].lease.buffer.start < cache._entries[(0, 1)].lease.buffer.start
    torch.manual_seed(1)
    hidden = torch.randn(2, 64)
    mine, theirs = model.model.layers[0].mlp.experts, ref["model"].model.layers[0].mlp.experts
    with torch.inference_mode():
        for rows, index in ((1, [[5, 1]]), (1, [[1, 5]]), (2, [[5, 1], [1, 3]])):
            idx, weights = torch.tensor(index), torch.softmax(torch.randn(rows, 2), -1)
            copied = experts.assembled["copied"]
            assert torch.equal(mine(hidden[:rows], idx, weights), theirs(hidden[:rows], idx, weights))
            assert experts.assembled["copied"] == (copied if rows == 1 else copied + 2)
    unstream(model)


@pytest.mark.parametrize("hooked", [False, True])
def test_damaged_expert_in_one_tokens_views(mixtral_ref: dict, tmp_path: Path, hooked: bool) -> None:
    """One token's two experts, handed over as views and computed while their CRC-32s are checked, one of
    them damaged: the layer raises naming it and returns nothing. With a hook inside the experts module
    (on its activation) the check comes before the computation, so the hook never sees a value computed
    from the damaged bytes. The expert leaves the cache; once the file is right the output is the
    in-memory experts'."""
    import shutil

    from deepnvme.offload.model import Placeholder

    d = Path(shutil.copytree(mixtral_ref["own"], tmp_path / "own"))
    weights, repair = damage_blob(d, "model.layers.0.mlp.experts.5")
    model = stream_weights(mixtral("grouped_mm", empty=True), d, BUDGET)
    experts = model._deepnvme_stream.experts
    mine, theirs = model.model.layers[0].mlp.experts, mixtral_ref["model"].model.layers[0].mlp.experts
    seen: list[int] = []
    if hooked:
        mine.act_fn.register_forward_hook(lambda *_: seen.append(1))
    torch.manual_seed(1)
    hidden, idx = torch.randn(1, 64), torch.tensor([[5, 1]])
    weights_ = torch.softmax(torch.randn(1, 2), -1)
    copied = experts.assembled["copied"]
    with torch.inference_mode():
        with pytest.raises(StoreError, match=rf"CRC-32 mismatch .* of {weights} .*experts\.5\.gate_up_proj"):
            mine(hidden, idx, weights_)
        assert seen == []
        assert isinstance(mine.gate_up_proj, Placeholder)
        assert (0, 5) not in experts.cache.cached()
        assert not any(e.in_use for e in experts.cache._entries.values())
        repair()
        assert torch.equal(mine(hidden, idx, weights_), theirs(hidden, idx, weights_))
    assert experts.assembled["copied"] == copied  # views, not copies: the unchecked path was the one taken
    assert seen == ([1] if hooked else [])
    unstream(model)


def test_read_ahead_goes_into_the_next_forward_for_a_batch_only(mixtral_ref: dict) -> None:
    """After the last layer, the read-ahead goes on into the next forward's first layers when that forward,
    one token per sequence, is expected to use nearly every expert too (a batch of 16), not after the
    prompt of one sequence (whose next forward is one token)."""
    model = stream_weights(mixtral("grouped_mm", empty=True), mixtral_ref["own"], BUDGET)
    cache = model._deepnvme_stream.experts.cache
    with torch.inference_mode():
        model(torch.arange(5, 17).view(1, 12))  # 12 tokens: 0.97 of each layer's experts expected used
        assert stats(model)["experts"]["ahead_reads"] > 0
        assert cache.read_order[-1][0] == 2  # read last: the last layer's experts, none of the next forward
        model(BATCH)
        assert cache.read_order[-1][0] in (0, 1)  # the next forward's first layers, read ahead
    unstream(model)


def test_damaged_expert_fails_its_crc_then_recovers(mixtral_ref: dict, tmp_path: Path) -> None:
    """An expert blob of deepnvme's store damaged on the drive: its CRC-32 (checked on the check thread,
    read ahead or on demand) fails the forward that uses it, naming the expert; once the file is right
    again the next forwards read it again and give the in-memory output."""
    import shutil

    from deepnvme.offload.model import Placeholder

    d = Path(shutil.copytree(mixtral_ref["own"], tmp_path / "own"))
    weights, repair = damage_blob(d, "model.layers.1.mlp.experts.5")
    model = stream_weights(mixtral("grouped_mm", empty=True), d, BUDGET)
    with pytest.raises(StoreError, match=rf"CRC-32 mismatch .* of {weights} .*experts\.5\.gate_up_proj"):
        batch_generate(model, steps=1)
    assert isinstance(model.model.layers[1].mlp.experts.gate_up_proj, Placeholder)
    assert stats(model)["experts"]["ahead_reads"] > 0
    repair()
    want = batch_generate(mixtral_ref["model"], steps=2)
    got = batch_generate(model, steps=2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    unstream(model)


def test_lookahead_bad_values(mixtral_ref: dict) -> None:
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="expert_lookahead must be an int >= 0"):
            stream_weights(mixtral("grouped_mm", empty=True), mixtral_ref["own"], BUDGET,
                           expert_lookahead=bad)  # type: ignore[arg-type]
    model = stream_weights(mixtral("grouped_mm", empty=True), mixtral_ref["own"], BUDGET, prefetch=False,
                           expert_lookahead=2)
    assert stats(model)["experts"]["lookahead"] == 0  # prefetch=False reads nothing ahead
    unstream(model)


def test_moved_and_converted_after_streaming(mixtral_ref: dict) -> None:
    """`.to(dtype)` reaches the experts' placeholders too: reads are converted, the output is the
    in-memory model's in that dtype (eager experts: grouped_mm has no float64 kernel; the weights are the
    same whatever the implementation)."""
    model = stream_weights(mixtral("eager", empty=True), mixtral_ref["own"], BUDGET)
    model.to("cpu").to(torch.float64)
    placeholder = model.model.layers[0].mlp.experts.gate_up_proj
    assert placeholder.dtype == torch.float64 and tuple(placeholder.shape) == (8, 256, 64)
    ref = mixtral("eager").to(torch.float64)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, ref(ids).logits)
    unstream(model)
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float64


def test_budget_too_small_for_an_expert(mixtral_ref: dict) -> None:
    with pytest.raises(ValueError, match="largest expert"):
        stream_weights(mixtral("grouped_mm", empty=True), mixtral_ref["own"], EXPERT)


def test_store_of_another_model(mixtral_ref: dict, tmp_path: Path) -> None:
    import transformers as tf

    cfg = mixtral("eager", empty=True).config
    cfg.intermediate_size = 96
    from accelerate import init_empty_weights

    with init_empty_weights():
        other = tf.MixtralForCausalLM(cfg).eval()
    with pytest.raises(StoreError, match="gate_up_proj"):
        stream_weights(other, mixtral_ref["own"], BUDGET)


# ------------------------------------------------------------------------------------- deepnvme.moe GPT
def gpt() -> torch.nn.Module:
    from deepnvme.moe.recipe.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=96, seq_length=64, num_layers=4, hidden_size=32, num_attention_heads=4,
                    num_experts=(4,), expert_interval=2, topk=2, min_capacity=1)
    return GPT(cfg, seed=0).eval()


def gpt_generate(model: torch.nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding of NEW_TOKENS tokens (the recipe's GPT has no KV cache: each step runs the whole
    sequence) and each step's logits."""
    idx, logits = PROMPT, []
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            out = model(idx)[0]
            logits.append(out)
            idx = torch.cat([idx, out[:, -1].argmax(-1, keepdim=True)], 1)
    return idx, logits


@pytest.fixture(scope="module")
def gpt_ref(tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = gpt()
    root = tmp_path_factory.mktemp("gpt")
    tokens, logits = gpt_generate(model)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, root / "model.safetensors")
    return {"model": model, "tokens": tokens, "logits": logits, "safetensors": root / "model.safetensors",
            "own": Path(write_store(model, root / "own"))}


@pytest.mark.parametrize("where", ["safetensors", "own"])
def test_deepnvme_moe_gpt_same_tokens_and_logits(gpt_ref: dict, where: str) -> None:
    sets = find_expert_sets(gpt_ref["model"])
    assert [(s.kind, s.num_experts) for s in sets] == [(MODULES, 4), (MODULES, 4)]
    expert = sum(p.numel() * 4 for p in sets[0].module.deepspeed_experts[0].parameters())
    model = stream_weights(gpt(), gpt_ref[where], 5 * expert)
    tokens, logits = gpt_generate(model)
    assert torch.equal(tokens, gpt_ref["tokens"])
    assert all(torch.equal(a, b) for a, b in zip(logits, gpt_ref["logits"]))
    # The cache holds fewer experts than a layer routes to: each runs by its own forward, on the rows the
    # layer in memory gives it as a group (the same products, so the same bits).
    assert model.blocks[1].mlp.deepspeed_moe.last_path == "rows, loop"
    e = stats(model)["experts"]
    assert e["experts"] == 8 and e["capacity_bytes"] < 8 * expert
    # Without a KV cache every step routes the whole sequence: nearly every expert of each layer runs, in
    # layer order, a cycle longer than the cache: experts are evicted and read again every step.
    assert e["evictions"] > 0 and 0 <= e["hit_rate"] < 1
    # Every step is expected to use nearly every expert: the next layers' are read ahead, one request per
    # expert read, from either store.
    assert e["ahead_reads"] > 0 and e["ahead_reads"] == e["guessed_reads"]
    assert e["read_requests"] == e["misses"] + e["guessed_reads"]
    assert e["tokens"] == sum(PROMPT.shape[1] + i for i in range(NEW_TOKENS))
    placeholder = model.blocks[1].mlp.deepspeed_moe.experts.deepspeed_experts[3].fc1.weight
    with pytest.raises(RuntimeError, match="streamed from the drive"):
        placeholder + 1
    unstream(model)
    assert all(torch.equal(a, b) for a, b in zip(gpt_generate(model)[1], gpt_ref["logits"]))
    for a, b in zip(model.state_dict().values(), gpt_ref["model"].state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("where", ["safetensors", "own"])
def test_deepnvme_moe_gpt_experts_computed_together_when_they_fit(gpt_ref: dict, where: str) -> None:
    """A cache that holds a layer's routed experts at once: they are computed as one group on views of the
    cached bytes, as the layer in memory computes them. deepnvme's store gives every expert the same pool
    bytes, so holding several at once cannot fragment the pool; from safetensors their sizes differ and
    they run one by one."""
    expert = sum(p.numel() * 4 for p in find_expert_sets(gpt_ref["model"])[0].module.deepspeed_experts[0]
                 .parameters())
    model = stream_weights(gpt(), gpt_ref[where], 40 * expert)
    tokens, logits = gpt_generate(model)
    assert torch.equal(tokens, gpt_ref["tokens"])
    assert all(torch.equal(a, b) for a, b in zip(logits, gpt_ref["logits"]))
    want = "rows, streamed segments" if where == "own" else "rows, loop"
    assert model.blocks[1].mlp.deepspeed_moe.last_path == want


def test_deepnvme_moe_gpt_with_a_hook_takes_the_in_memory_path(gpt_ref: dict) -> None:
    """A hook inside an expert sends the layer in memory through the loop over padded blocks; the streamed
    layer goes the same way (not the grouped rows), so its outputs are still the same bits and the hook
    sees the same inputs."""
    seen: dict[str, list[tuple[int, ...]]] = {"memory": [], "streamed": []}

    def hooked(model: torch.nn.Module, where: str) -> torch.nn.Module:
        fc1 = model.blocks[1].mlp.deepspeed_moe.experts.deepspeed_experts[0].fc1
        fc1.register_forward_hook(lambda _m, args, _out: seen[where].append(tuple(args[0].shape)))
        return model

    ref = hooked(gpt(), "memory")
    want_tokens, want_logits = gpt_generate(ref)
    expert = sum(p.numel() * 4 for p in find_expert_sets(gpt_ref["model"])[0].module.deepspeed_experts[0]
                 .parameters())
    model = stream_weights(hooked(gpt(), "streamed"), gpt_ref["own"], 40 * expert)
    tokens, logits = gpt_generate(model)
    assert torch.equal(tokens, want_tokens)
    assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    assert ref.blocks[1].mlp.deepspeed_moe.last_path == model.blocks[1].mlp.deepspeed_moe.last_path
    assert model.blocks[1].mlp.deepspeed_moe.last_path.startswith("padded")
    assert seen["memory"] == seen["streamed"] and seen["memory"]


def test_damaged_moe_expert_fails_its_crc_then_recovers(gpt_ref: dict, tmp_path: Path) -> None:
    """A deepnvme.moe expert damaged on the drive: the expert computes while its CRC-32 is checked, and
    the layer fails naming the file before any output leaves it; the model keeps its placeholders, and
    once the file is right again it decodes the in-memory tokens."""
    import json
    import shutil

    from deepnvme.offload.model import Placeholder

    d = Path(shutil.copytree(gpt_ref["own"], tmp_path / "own"))
    units = [b["unit"] for b in json.loads((d / "manifest.json").read_text())["blobs"]]
    unit = next(u for u in units if u.startswith("blocks.1.") and u.endswith("deepspeed_experts.2"))
    weights, repair = damage_blob(d, unit)
    sets = find_expert_sets(gpt_ref["model"])
    expert = sum(p.numel() * 4 for p in sets[0].module.deepspeed_experts[0].parameters())
    model = stream_weights(gpt(), d, 5 * expert)
    with pytest.raises(StoreError, match=rf"CRC-32 mismatch .* of {weights} .*deepspeed_experts\.2"):
        gpt_generate(model)
    victim = model.blocks[1].mlp.deepspeed_moe.experts.deepspeed_experts[2]
    assert all(isinstance(p, Placeholder) for p in victim.parameters())
    cache = model._deepnvme_stream.experts.cache
    assert not any(e.in_use for e in cache._entries.values())
    repair()
    tokens, logits = gpt_generate(model)
    assert torch.equal(tokens, gpt_ref["tokens"])
    assert all(torch.equal(a, b) for a, b in zip(logits, gpt_ref["logits"]))
    unstream(model)


def test_interrupted_forward_leaves_the_model_usable(gpt_ref: dict) -> None:
    """Ctrl-C inside an MoE layer, after the layer asked for its experts and before it ran them all: the
    placeholders are back, the cache forgets the request, the next forwards give the in-memory output."""
    sets = find_expert_sets(gpt_ref["model"])
    expert = sum(p.numel() * 4 for p in sets[0].module.deepspeed_experts[0].parameters())
    model = stream_weights(gpt(), gpt_ref["own"], 5 * expert)
    victim = model.blocks[1].mlp.deepspeed_moe.experts.deepspeed_experts[2]

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    hook = victim.register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), torch.inference_mode():
        model(PROMPT)
    hook.remove()
    cache = model._deepnvme_stream.experts.cache
    assert not any(e.in_use for e in cache._entries.values())  # nothing held; the next request resets
    from deepnvme.offload.model import Placeholder

    assert all(isinstance(p, Placeholder) for p in victim.parameters())
    tokens, logits = gpt_generate(model)
    assert torch.equal(tokens, gpt_ref["tokens"])
    assert all(torch.equal(a, b) for a, b in zip(logits, gpt_ref["logits"]))
    unstream(model)
