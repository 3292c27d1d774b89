"""deepnvme.offload.from_pretrained: a model folder as save_pretrained writes it, to generate() in one call,
with the same tokens as transformers' own from_pretrained in memory (greedy and sampled, KV cache on), on
tiny GPT-2, Llama, Mixtral and Qwen2-MoE (shared expert) configurations; embeddings and head streamed as
units; the folder left as it was; bad folders named."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.offload.stream_models import PROMPT, require_hf

require_hf()

from deepnvme.offload import StoreError, from_pretrained, stats, stream_weights, unstream  # noqa: E402
from deepnvme.offload.infer.rows import ROWS_FROM  # noqa: E402

NEW = 24


def config(kind: str) -> Any:
    import transformers as tf

    common = dict(vocab_size=96, max_position_embeddings=96, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                  num_attention_heads=4, num_key_value_heads=2)
    if kind == "gpt2":
        return tf.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=96, n_positions=96, bos_token_id=0,
                             eos_token_id=0)
    if kind == "llama":
        return tf.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=160, **common)
    if kind == "mixtral":
        return tf.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                num_local_experts=8, num_experts_per_tok=2, **common)
    return tf.Qwen2MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                             shared_expert_intermediate_size=96, num_hidden_layers=3, num_experts=8,
                             num_experts_per_tok=2, decoder_sparse_step=1, **common)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """folders(kind, dtype): a save_pretrained folder of that model (sharded for Llama and Qwen2-MoE)."""
    import transformers as tf

    made: dict[tuple[str, torch.dtype], Path] = {}

    def get(kind: str, dtype: torch.dtype = torch.float32) -> Path:
        if (kind, dtype) not in made:
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(config(kind)).to(dtype).eval()
            root = tmp_path_factory.mktemp(f"{kind}-{str(dtype)[6:]}")
            shard = {"max_shard_size": "200KB"} if kind in ("llama", "qwen2_moe") else {}
            model.save_pretrained(root, safe_serialization=True, **shard)
            made[(kind, dtype)] = root
        return made[(kind, dtype)]
    return get


def generate(model: torch.nn.Module, sample: bool) -> torch.Tensor:
    torch.manual_seed(1234)
    kw = dict(do_sample=True, top_k=20, temperature=0.9) if sample else dict(do_sample=False)
    with torch.inference_mode():
        return model.generate(PROMPT, max_new_tokens=NEW, min_new_tokens=NEW, use_cache=True, **kw)


def in_memory(folder: Path) -> torch.nn.Module:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral", "qwen2_moe"])
def test_one_call_gives_the_tokens_of_the_model_in_memory(folders: Any, kind: str) -> None:
    folder = folders(kind)
    ref = in_memory(folder)
    before = listing(folder)
    total = sum(p.numel() * 4 for p in ref.parameters())
    budget = total // 3
    model = from_pretrained(folder, budget)
    assert type(model) is type(ref) and not model.training
    for sample in (False, True):
        assert torch.equal(generate(model, sample), generate(ref, sample)), f"sample={sample}"
    s = stats(model)
    assert s["budget_bytes"] <= budget and s["unit_reads"] > 0
    streamed = s["streamed_bytes"] + s.get("experts", {}).get("expert_bytes", 0)
    assert streamed + s["resident_bytes"] >= 0.95 * total - 2 * 96 * 64 * 4  # a tied head counted once
    assert listing(folder) == before  # read in place: nothing written beside the checkpoint
    assert not any(folder.rglob("*offload*"))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_embeddings_and_head_streamed(folders: Any, kind: str) -> None:
    """embeddings=True: Llama's input table (untied, a plain nn.Embedding) is read by rows, its head is a
    unit; GPT-2's tied table is one tensor read by two units (the input table and the head)."""
    folder = folders(kind)
    ref = in_memory(folder)
    model = from_pretrained(folder, 1 << 20, embeddings=True)
    for sample in (False, True):
        assert torch.equal(generate(model, sample), generate(ref, sample))
    s = stats(model)
    table = 96 * 64 * 4
    if kind == "gpt2":
        assert s["units"] == 6 and "row_lookups" not in s  # four blocks, the input table and the head
    else:
        assert s["units"] == 5 and s["row_table_bytes"] == table  # four blocks and the head
        # each lookup reads only the rows it names: the prompt's distinct ids once, then one per step
        assert s["row_lookups"] == 2 * NEW  # two generate() calls, one forward per new token
        assert s["rows_read"] <= 2 * (len(set(PROMPT[0].tolist())) + NEW)
        assert s["row_bytes_read"] == s["rows_read"] * 64 * 4
    # What stays in memory is the small rest: the final norm (and GPT-2's position table, 96 x 64).
    assert s["resident_bytes"] <= (table if kind == "gpt2" else 0) + 1024
    with pytest.raises(RuntimeError, match="streamed from the drive"):
        model.get_input_embeddings().weight + 1
    unstream(model)
    assert torch.equal(generate(model, False), generate(ref, False))
    if kind == "gpt2":  # tied again once back in memory
        assert model.lm_head.weight is model.transformer.wte.weight


def large_vocab(tmp_path: Path, vocab: int = 8192) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    return ref


def test_embeddings_auto(tmp_path: Path) -> None:
    """By default an input table of at least rows.ROWS_FROM bytes is read by rows; the head stays in memory
    while the budget and it fit in the memory the process has left (here: gigabytes)."""
    ref = large_vocab(tmp_path)  # each table 1 MiB, a block about 33 KB
    table = 8192 * 32 * 4
    assert table >= ROWS_FROM
    model = from_pretrained(tmp_path, 2 << 20)
    s = stats(model)
    assert s["units"] == 2 and s["row_table_bytes"] == table and table <= s["resident_bytes"] < table + 1024
    assert torch.equal(generate(model, False), generate(ref, False))
    off = stats(from_pretrained(tmp_path, 2 << 20, embeddings=False))
    assert off["units"] == 2 and off["resident_bytes"] >= 2 * table and "row_lookups" not in off
    on = stats(from_pretrained(tmp_path, 2 << 20, embeddings=True))
    assert on["units"] == 3 and on["resident_bytes"] < 1024 and on["row_table_bytes"] == table
    with pytest.raises(ValueError, match="budget_bytes"):
        from_pretrained(tmp_path, 300 << 10, embeddings=True)
    with pytest.raises(TypeError, match="embeddings"):
        from_pretrained(tmp_path, 2 << 20, embeddings="yes")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tables_are_units_only_when_they_do_not_fit(kind: str) -> None:
    """table_units' auto rule on the model's own modules: nothing while budget + tables fit the room the
    process has left (or the room is unknown); when they do not, the head (with the input table it is
    tied to: GPT-2's, one weight) if it outweighs a block and fits the budget."""
    import transformers as tf

    from deepnvme.offload.model import table_units, unit_modules

    with __import__("accelerate").init_empty_weights():
        model = tf.AutoModelForCausalLM.from_config(config(kind))
    model.tie_weights()
    blocks = unit_modules(model, None)
    block = max(sum(p.numel() * 4 for p in m.parameters()) for _, m in blocks)
    table = 96 * 64 * 4
    if table <= block:  # the tiny configurations: make a block lighter than the table by choosing less
        blocks = [(n + ".ln_1" if kind == "gpt2" else n + ".input_layernorm", m.get_submodule(
            "ln_1" if kind == "gpt2" else "input_layernorm")) for n, m in blocks]
    budget = 1 << 20
    assert table_units(model, blocks, None, budget, None) == []
    assert table_units(model, blocks, None, budget, 1 << 30) == []
    tight = table_units(model, blocks, None, budget, budget + table - 1)
    want = ["transformer.wte", "lm_head"] if kind == "gpt2" else ["lm_head"]
    assert sorted(n for n, _ in tight) == sorted(want)
    assert table_units(model, blocks, None, table - 1, 0) == []  # a table must fit the budget to stream
    assert sorted(n for n, _ in table_units(model, blocks, True, budget, None)) == sorted(want)
    assert table_units(model, blocks, False, budget, 0) == []


def test_row_reads_are_checked_and_bounded(tmp_path: Path) -> None:
    """A row changed in the file after streaming started is a StoreError naming the file, the tensor and the
    row (other rows still read); an id past the table an IndexError; a converted model gets converted
    rows; fds are closed by unstream."""
    from safetensors import safe_open

    ref = large_vocab(tmp_path)
    model = from_pretrained(tmp_path, 2 << 20)
    path = tmp_path / "model.safetensors"
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    with safe_open(str(path), "pt") as f:
        start = f.get_slice("model.embed_tokens.weight")
    import json

    meta = json.loads(path.read_bytes()[8:8 + header])["model.embed_tokens.weight"]
    row_at = 8 + header + meta["data_offsets"][0] + 77 * 32 * 4
    del start
    ids = torch.tensor([[5, 77, 9]])
    with torch.inference_mode():
        want = ref.get_input_embeddings()(ids)
        assert torch.equal(model.get_input_embeddings()(ids), want)
        with open(path, "r+b") as f:
            f.seek(row_at)
            old = f.read(4)
            f.seek(row_at)
            f.write(bytes(b ^ 0xFF for b in old))
        with pytest.raises(StoreError, match=r"row 77 of tensor 'model.embed_tokens.weight'") as err:
            model.get_input_embeddings()(ids)
        assert str(path) in str(err.value)
        assert torch.equal(model.get_input_embeddings()(torch.tensor([[5, 9]])), want[:, [0, 2]])
        with pytest.raises(IndexError, match="out of range"):
            model.get_input_embeddings()(torch.tensor([[8192]]))
        with pytest.raises(IndexError, match="out of range"):
            model.get_input_embeddings()(torch.tensor([[-1]]))
        with pytest.raises(TypeError, match="must be a tensor"):
            model.get_input_embeddings()([[5]])
        with open(path, "r+b") as f:  # put it back
            f.seek(row_at)
            f.write(old)
        model.half()
        got = model.get_input_embeddings()(ids)
        assert got.dtype == torch.float16 and torch.equal(got, want.half())
    fds = len(os.listdir("/proc/self/fd"))
    unstream(model)
    assert len(os.listdir("/proc/self/fd")) < fds
    assert model.get_input_embeddings().weight.dtype == torch.float16


def test_bf16_checkpoint_loads_in_its_dtype(folders: Any) -> None:
    folder = folders("llama", torch.bfloat16)
    ref = in_memory(folder)
    assert ref.dtype == torch.bfloat16
    model = from_pretrained(folder, 200_000)
    assert model.dtype == torch.bfloat16
    assert torch.equal(generate(model, False), generate(ref, False))
    as_fp32 = from_pretrained(folder, 400_000, dtype="float32")
    assert as_fp32.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        from_pretrained(folder, 400_000, dtype="float99")


def test_generation_config_is_the_folders(folders: Any, tmp_path: Path) -> None:
    import shutil

    import transformers as tf

    folder = tmp_path / "gen"
    shutil.copytree(folders("llama"), folder)
    tf.GenerationConfig(max_new_tokens=5, do_sample=False, bos_token_id=0, eos_token_id=0,
                        pad_token_id=0).save_pretrained(folder)
    model = from_pretrained(folder, 200_000)
    assert model.generation_config.max_new_tokens == 5
    with torch.inference_mode():
        out = model.generate(PROMPT)
    assert out.shape[1] == PROMPT.shape[1] + 5


def test_bad_folders_are_named(folders: Any, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        from_pretrained(tmp_path / "nowhere", 1 << 20)
    assert err.value.errno == errno.ENOENT and err.value.filename == str(tmp_path / "nowhere")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(NotADirectoryError) as notdir:
        from_pretrained(tmp_path / "a_file", 1 << 20)
    assert notdir.value.errno == errno.ENOTDIR and notdir.value.filename == str(tmp_path / "a_file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        from_pretrained(tmp_path / "empty", 1 << 20)
    assert err.value.filename.endswith("config.json")
    import shutil

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(folders("llama") / "config.json", no_weights)
    with pytest.raises(FileNotFoundError) as err:
        from_pretrained(no_weights, 1 << 20)
    assert err.value.filename == str(no_weights) and "model.safetensors" in str(err.value)
    other = tmp_path / "other"
    shutil.copytree(folders("llama"), other)
    shutil.copy(folders("gpt2") / "config.json", other)  # a config for another model
    with pytest.raises(StoreError, match="not in the store"):
        from_pretrained(other, 1 << 20)
    with pytest.raises(ValueError, match="budget_bytes"):
        from_pretrained(folders("llama"), 1000)
    with pytest.raises(TypeError, match="folder"):
        from_pretrained(123, 1 << 20)  # type: ignore[arg-type]
    # A failed call leaves no descriptor open on the folder's files.
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError):
        from_pretrained(folders("llama"), 1000)
    assert len(os.listdir("/proc/self/fd")) == fds


def test_the_same_model_streamed_twice_is_refused(folders: Any) -> None:
    model = from_pretrained(folders("gpt2"), 1 << 20)
    with pytest.raises(RuntimeError, match="streamed already"):
        stream_weights(model, folders("gpt2"), 1 << 20)


def test_row_reads_in_a_forked_child(tmp_path: Path) -> None:
    """A forked child decodes with the rows read by the descriptor it inherited (pread has no shared file
    position), the same tokens as the parent."""
    ref = large_vocab(tmp_path)
    model = from_pretrained(tmp_path, 2 << 20)
    want = generate(model, False)
    assert torch.equal(want, generate(ref, False))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            torch.set_num_threads(1)
            code = 0 if torch.equal(generate(model, False), want) else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"\x00"
    assert torch.equal(generate(model, False), want)  # the parent goes on


def test_row_reads_take_the_childs_lock_after_fork(tmp_path: Path) -> None:
    """A parent thread inside a forward (holding the model's lock) when another forks: the child's lookups
    take the child's own lock, as its blocks do, instead of waiting for good on the inherited one."""
    import signal
    import threading

    from deepnvme.offload.infer.running import streamer_of

    large_vocab(tmp_path)
    model = from_pretrained(tmp_path, 2 << 20)
    st = streamer_of(model)
    assert st.rows is not None
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with st.lock:
            held.set()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            signal.alarm(20)  # a hang ends as a failure, not a stuck test
            with torch.inference_mode():
                out = model.get_input_embeddings()(torch.tensor([[1, 2, 3]]))
            code = 0 if out.shape == (1, 3, 32) else 2
        finally:
            os.write(w, bytes([code]))
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    release.set()
    t.join()
    assert got == b"\x00"


def test_fp16_keeps_the_modules_the_model_class_keeps_in_fp32(tmp_path: Path) -> None:
    """transformers' from_pretrained keeps a model class's `_keep_in_fp32_modules` in fp32 when loading in
    fp16; the one call does the same, so the logits are the same bits."""
    import transformers as tf

    cfg = tf.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.1)  # norms of ones would round to the same fp16 and fp32 values
    model.save_pretrained(tmp_path)
    ref = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float16).eval()
    assert ref.model.layers[0].input_layernorm.weight.dtype == torch.float32
    ours = from_pretrained(tmp_path, 1 << 20, dtype=torch.float16)
    dtypes = {n: t.dtype for n, t in ours.named_parameters()}
    assert dtypes == {n: t.dtype for n, t in ref.named_parameters()}
    ids = torch.tensor([[1, 5, 9, 13, 22, 40]])
    with torch.inference_mode():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


def test_auto_weighs_moe_blocks_without_experts_and_never_fails(tmp_path: Path) -> None:
    """An MoE block's experts are streamed on their own, so the auto rule weighs a block without them (a
    Mixtral head of 1 MiB outweighs a 51 KB block); a head whose reads would not fit the budget beside the
    largest expert stays in memory rather than failing the call."""
    import transformers as tf
    from accelerate import init_empty_weights

    from deepnvme.offload.experts import ExpertStreamer
    from deepnvme.offload.infer.weights import _match_units
    from deepnvme.offload.model import table_units, unit_modules
    from deepnvme.offload.stores import open_store

    cfg = tf.MixtralConfig(vocab_size=4096, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                           num_local_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                           num_key_value_heads=2, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    tf.MixtralForCausalLM(cfg).save_pretrained(tmp_path)
    with init_empty_weights():
        model = tf.MixtralForCausalLM(cfg)
    store = open_store(tmp_path)
    try:
        experts = ExpertStreamer.for_model(model, store)
        assert experts is not None
        blocks = unit_modules(model, None)
        assert [n for n, _ in table_units(model, blocks, None, 8 << 20, 0, experts.owned)] == ["lm_head"]
        assert table_units(model, blocks, None, 8 << 20, 0) == []  # weighed with experts: none
        chosen, _, residents = _match_units(model, store, None, None, 8 << 20, experts, room=0)
        assert chosen[-1][0] == "lm_head"
        head = 4096 * 64 * 4
        tight = head + experts.largest - 4096  # the head alone fits, not beside the largest expert
        chosen, _, residents = _match_units(model, store, None, None, tight, experts, room=0)
        assert "lm_head" not in [n for n, _ in chosen]
        assert any(r.info.name == "lm_head.weight" for r in residents)
    finally:
        store.close()
    ref = tf.MixtralForCausalLM.from_pretrained(tmp_path).eval()
    ours = from_pretrained(tmp_path, 2 << 20)
    assert torch.equal(generate(ours, False), generate(ref, False))
