"""stream_weights on Hugging Face models: the same tokens and logits as in memory, from every store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deepnvme.offload import (
    StreamedWeightError,
    load_safetensors,
    stats,
    stream_weights,
    unstream,
    write_store,
)
from tests.offload.stream_models import BUDGET, NEW_TOKENS, PROMPT, build, generate, require_hf, save

require_hf()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(kind: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The in-memory model, its output, and its weights in each kind of store."""
    model = build(kind)
    root = tmp_path_factory.mktemp(kind)
    tokens, logits = generate(model)
    return {"model": model, "tokens": tokens, "logits": logits,
            "single": save(model, root / "single"), "sharded": save(model, root / "sharded", "100KB"),
            "own": Path(write_store(model, root / "own"))}


@pytest.mark.parametrize("where", ["single", "sharded", "own"])
def test_same_tokens_and_logits_as_in_memory(kind: str, reference: dict, where: str) -> None:
    if where == "sharded":
        assert len(list(reference["sharded"].glob("*.safetensors"))) > 2
    model = stream_weights(build(kind, empty=True), reference[where], BUDGET)
    if kind == "gpt2":  # the head is the embedding (tied), read once from the one tensor the store has
        assert model.lm_head.weight is model.transformer.wte.weight
    tokens, logits = generate(model)
    assert tokens.shape[1] == PROMPT.shape[1] + NEW_TOKENS
    assert torch.equal(tokens, reference["tokens"])
    assert torch.equal(logits, reference["logits"])
    s = stats(model)
    block = s["streamed_bytes"] // s["units"]
    assert s["units"] == 4 and s["order_recorded"] and s["forwards"] == NEW_TOKENS + 1
    assert s["unit_reads"] == 4 * s["forwards"]
    assert s["streamed_bytes"] * s["forwards"] <= s["bytes_read"] <= (block + 2 * 4096 * 4) * s["unit_reads"]
    assert s["hits"] + s["stalls"] == s["unit_reads"], s  # hits > 0: test_stream_plain
    assert 0 < s["pool_peak_bytes"] <= s["budget_bytes"] == BUDGET
    assert s["resident_bytes"] > 0 and s["wait_s"] >= 0


def test_in_memory_model_streamed_and_unstreamed(kind: str, reference: dict) -> None:
    """Streaming a model that has its weights frees them; unstream reads them back: same values."""
    model = build(kind)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stream_weights(model, reference["own"], BUDGET, prefetch=False)
    tokens, _ = generate(model)
    assert torch.equal(tokens, reference["tokens"])
    assert stats(model)["hits"] == 0
    unstream(model)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    with pytest.raises(ValueError, match="not streamed"):
        stats(model)
    assert torch.equal(generate(model)[0], reference["tokens"])


def test_placeholder_touched_outside_its_forward(kind: str, reference: dict) -> None:
    model = stream_weights(build(kind, empty=True), reference["single"], BUDGET)
    block = model.transformer.h[1] if kind == "gpt2" else model.model.layers[1]
    name, weight = next((n, p) for n, p in block.named_parameters() if p.dim() == 2)
    assert weight.device.type == "cpu" and weight.dtype == torch.float32
    with pytest.raises(StreamedWeightError, match=rf"{name}.*unit '.*\.1'.*unstream"):
        weight.sum()
    with pytest.raises(StreamedWeightError):
        model.state_dict()
    assert "Placeholder" in repr(weight)
    assert torch.equal(generate(model)[0], reference["tokens"])


def test_model_to_eval_no_grad_and_dtype(kind: str, reference: dict) -> None:
    model = stream_weights(build(kind, empty=True), reference["own"], BUDGET)
    model.to("cpu").eval()
    with torch.no_grad():
        assert torch.equal(model(reference["tokens"]).logits, reference["logits"])
    model.to(torch.float64)
    ref64 = build(kind).to(torch.float64)
    with torch.no_grad():
        got = model(reference["tokens"]).logits
        assert got.dtype == torch.float64
        assert torch.equal(got, ref64(reference["tokens"]).logits)


def test_backward_through_streamed_weights_raises(kind: str, reference: dict) -> None:
    model = stream_weights(build(kind, empty=True), reference["own"], BUDGET)
    emb = model.get_input_embeddings()(PROMPT).detach().requires_grad_(True)
    out = model(inputs_embeds=emb).logits.sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_load_safetensors(kind: str, reference: dict) -> None:
    want = reference["model"].state_dict()
    for where in ("single", "sharded"):
        got = load_safetensors(reference[where])
        for k, v in got.items():
            assert torch.equal(v, want[k]), k
        assert len(got) >= len(want) - 1  # the tied head is saved once


def test_load_safetensors_matches_safetensors_and_refuses_bad_paths(reference: dict, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    file = reference["single"] / "model.safetensors"
    want = load_file(file)
    got = load_safetensors(file, budget_bytes=64 << 10)  # many chunks, tensors cut across them
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert len({v.untyped_storage().data_ptr() for v in got.values()}) == len(got)  # tensors of their own
    with pytest.raises(FileNotFoundError):
        load_safetensors(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_safetensors(tmp_path / "empty")


def test_write_store_replaces_a_store_atomically(reference: dict, kind: str, tmp_path: Path) -> None:
    """A second write_store into the same directory replaces the store whole and removes the old weights;
    a state dict is stored as well as a model."""
    d = tmp_path / "store"
    write_store(reference["model"].state_dict(), d)
    first = sorted(os.listdir(d))
    write_store(reference["model"], d)
    second = sorted(os.listdir(d))
    assert len(first) == len(second) == 2 and first != second
    model = stream_weights(build(kind, empty=True), d, BUDGET)
    assert torch.equal(generate(model)[0], reference["tokens"])
    with pytest.raises(ValueError, match="meta device"):
        write_store(build(kind, empty=True), tmp_path / "other")


def test_budget_holding_every_unit_reads_each_once(kind: str, reference: dict) -> None:
    model = stream_weights(build(kind, empty=True), reference["own"], 8 << 20)
    tokens, logits = generate(model)
    assert torch.equal(tokens, reference["tokens"]) and torch.equal(logits, reference["logits"])
    s = stats(model)
    assert s["unit_reads"] <= 2 * s["units"], s  # the recording pass, then each unit read ahead once
    assert s["cache_hits"] == s["units"] * s["forwards"] - s["unit_reads"] > 0, s


def _cached_pages(path: Path) -> int:
    """Pages of `path` in the page cache (mincore over a mapping, which itself brings none in)."""
    import ctypes
    import mmap

    from deepnvme._core.memory import address_of

    size = path.stat().st_size
    vec = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = memoryview(m)
        try:
            if libc.mincore(ctypes.c_void_p(address_of(view)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed", str(path))
        finally:
            view.release()
    return sum(v & 1 for v in vec)


def test_reads_bypass_the_page_cache(kind: str, reference: dict, tmp_path: Path) -> None:
    """Streaming from safetensors reads with O_DIRECT: the checkpoint's pages do not enter the page
    cache (only the header's, read once with ordinary reads when the store opens)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    file = d / "model.safetensors"
    data = (reference["single"] / "model.safetensors").read_bytes()
    file.write_bytes(data)
    header_pages = -(-(8 + int.from_bytes(data[:8], "little")) // 4096)
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if _cached_pages(file) > 0:
        pytest.skip("the page cache kept this file's pages (POSIX_FADV_DONTNEED not honoured here)")
    model = stream_weights(build(kind, empty=True), d, BUDGET)
    assert torch.equal(generate(model)[0], reference["tokens"])
    assert stats(model)["bytes_read"] > 4 * len(data)
    assert _cached_pages(file) <= header_pages + 1, (_cached_pages(file), header_pages, len(data) // 4096)
