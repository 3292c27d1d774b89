"""stream_weights with bad input: stores that lie or do not fit, budgets too small, misuse, threads, Ctrl-C.

Each case gets an exception naming the tensor and the file (or the unit and the sizes), never wrong
output, and the model stays usable afterwards where the cause is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from deepnvme.offload import (
    SafetensorsStore,
    StoreError,
    stats,
    stream_weights,
    unstream,
    write_store,
)
from deepnvme.offload.model import Placeholder
from tests.offload.helpers import open_fds
from tests.offload.stream_models import BUDGET, PROMPT, build, generate, require_hf, save
from tests.support.stream_helpers import damage_blob
from tests.support.thread_helpers import run_threads

require_hf()


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    model = build("gpt2")
    root = tmp_path_factory.mktemp("gpt2")
    return {"model": model, "tokens": generate(model)[0], "single": save(model, root / "single"),
            "sharded": save(model, root / "sharded", "100KB"), "own": Path(write_store(model, root / "own"))}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_header(file: Path, edit: object) -> None:
    """Replace the JSON header of a safetensors file by edit(header), keeping the data bytes."""
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)  # type: ignore[operator]
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n, "the edit must not grow the header"
    file.write_bytes(raw[:8] + new + raw[8 + n:])


def _name_of_block_weight(header: dict, block: int = 2) -> str:
    return next(k for k in sorted(header)
                if k.startswith(f"transformer.h.{block}.") and k.endswith("c_fc.weight"))


def test_unit_larger_than_the_budget(gpt2: dict) -> None:
    with pytest.raises(ValueError, match=r"unit 'transformer.h.0' takes \d+ bytes.*budget_bytes=65536"):
        stream_weights(build("gpt2", empty=True), gpt2["own"], 64 << 10)


def test_store_of_another_model(gpt2: dict) -> None:
    with pytest.raises(StoreError, match=r"tensors of the model are not in the store .*single.*another"):
        stream_weights(build("llama", empty=True), gpt2["single"], BUDGET)


def test_shape_mismatch_names_tensor_and_file(gpt2: dict, tmp_path: Path) -> None:
    import transformers as tf

    other = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=96, n_positions=80))
    path = save(other, tmp_path / "other")
    with pytest.raises(StoreError, match=r"'transformer.wpe.weight' in .*safetensors: shape \(80, 64\)"):
        stream_weights(build("gpt2", empty=True), path, BUDGET)


def test_missing_tensor(gpt2: dict, tmp_path: Path) -> None:
    d = _copy(gpt2["single"], tmp_path / "c")
    file = d / "model.safetensors"
    gone = []

    def drop(h: dict) -> None:
        gone.append(_name_of_block_weight(h))
        del h[gone[0]]

    _rewrite_header(file, drop)
    with pytest.raises(StoreError, match=rf"1 tensors .*'{gone[0]}'"):
        stream_weights(build("gpt2", empty=True), d, BUDGET)


def test_truncated_file(gpt2: dict, tmp_path: Path) -> None:
    d = _copy(gpt2["single"], tmp_path / "c")
    file = d / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    with pytest.raises(StoreError, match=rf"tensor '.*' in {file}: its data ends .* truncated"):
        SafetensorsStore(d)


@pytest.mark.parametrize("lie", ["offsets", "dtype", "unknown dtype", "overlap", "header length"])
def test_header_that_lies(gpt2: dict, tmp_path: Path, lie: str) -> None:
    d = _copy(gpt2["single"], tmp_path / "c")
    file = d / "model.safetensors"
    names = []

    def edit(h: dict) -> None:
        name = _name_of_block_weight(h)
        names.append(name)
        e = h[name]
        if lie == "offsets":
            e["data_offsets"][1] -= 4
        elif lie == "dtype":
            e["dtype"] = "F16"
        elif lie == "unknown dtype":
            e["dtype"] = "F17"
        elif lie == "overlap":
            e["data_offsets"] = [e["data_offsets"][0] - 8, e["data_offsets"][1] - 8]

    if lie == "header length":
        raw = file.read_bytes()
        file.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
        with pytest.raises(StoreError, match=rf"{file}: header length .* does not fit"):
            SafetensorsStore(d)
        return
    _rewrite_header(file, edit)
    expect = {"offsets": "lies about offsets or dtype", "dtype": "lies about offsets or dtype",
              "unknown dtype": "unknown dtype 'F17'", "overlap": "overlap"}[lie]
    with pytest.raises(StoreError, match=expect) as err:
        SafetensorsStore(d)
    assert str(file) in str(err.value) and names[0] in str(err.value)


def test_index_placing_a_tensor_in_the_wrong_shard(gpt2: dict, tmp_path: Path) -> None:
    d = _copy(gpt2["sharded"], tmp_path / "c")
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = sorted(data["weight_map"])[0]
    others = sorted(set(data["weight_map"].values()) - {data["weight_map"][name]})
    data["weight_map"][name] = others[0]
    index.write_text(json.dumps(data))
    with pytest.raises(StoreError, match=rf"'{name}': .*index.json places it in .*{others[0]}"):
        SafetensorsStore(d)


def test_damaged_own_store_fails_its_crc_then_recovers(gpt2: dict, tmp_path: Path) -> None:
    weights, repair = damage_blob(_copy(gpt2["own"], tmp_path / "c"), "transformer.h.2")
    model = stream_weights(build("gpt2", empty=True), weights.parent, BUDGET)
    with pytest.raises(StoreError, match=rf"CRC-32 mismatch .* of {weights} .*transformer.h.2"):
        generate(model)
    assert isinstance(model.transformer.h[2].mlp.c_fc.weight, Placeholder)
    repair()
    assert torch.equal(generate(model)[0], gpt2["tokens"])


def test_file_cut_short_under_a_streamed_model(gpt2: dict, tmp_path: Path) -> None:
    d = _copy(gpt2["single"], tmp_path / "c")
    file = d / "model.safetensors"
    keep = file.read_bytes()
    model = stream_weights(build("gpt2", empty=True), d, BUDGET, prefetch=False)
    os.truncate(file, 4096)
    with pytest.raises(OSError) as err:
        generate(model)
    assert err.value.filename == str(file)
    file.write_bytes(keep)
    assert torch.equal(generate(model)[0], gpt2["tokens"])


def test_meta_device_models(gpt2: dict, tmp_path: Path) -> None:
    """GPT-2 built on torch.device("meta") runs from the store alone; Llama's rotary frequencies are a
    buffer no checkpoint holds, so on the meta device it is refused with the way out."""
    import transformers as tf

    from tests.offload.stream_models import config

    with torch.device("meta"):
        model = tf.GPT2LMHeadModel(config("gpt2")).eval()
    stream_weights(model, gpt2["sharded"], BUDGET)
    assert torch.equal(generate(model)[0], gpt2["tokens"])
    with torch.device("meta"):
        llama = tf.LlamaForCausalLM(config("llama"))
    with pytest.raises(StoreError, match="inv_freq.*init_empty_weights"):
        stream_weights(llama, save(build("llama"), tmp_path / "llama"), BUDGET)


def test_misuse(gpt2: dict) -> None:
    """Wrong calls raise before anything changes; no descriptor is left open by them or by unstream."""
    model = build("gpt2", empty=True)
    fds = open_fds()
    with pytest.raises(ValueError, match="not streamed"):
        unstream(model)
    with pytest.raises(ValueError, match="'transformer.h.0' lies inside 'transformer.h'"):
        stream_weights(model, gpt2["own"], BUDGET, units=["transformer.h", "transformer.h.0"])
    with pytest.raises(ValueError, match="no such module"):
        stream_weights(model, gpt2["own"], BUDGET, units="transformer.blocks")
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        stream_weights(model, gpt2["own"], 1.5e6)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        stream_weights(model, gpt2["own"] / "nothing", BUDGET)
    with pytest.raises(ValueError, match="unit 'transformer.h.0' takes"):
        stream_weights(model, gpt2["single"], 8 << 10)
    assert open_fds() == fds
    stream_weights(model, gpt2["own"], BUDGET, units="transformer.h")
    with pytest.raises(RuntimeError, match="streamed already"):
        stream_weights(model, gpt2["own"], BUDGET)
    assert torch.equal(generate(model)[0], gpt2["tokens"])
    unstream(model)
    assert open_fds() == fds


def test_two_threads_are_serialized(gpt2: dict) -> None:
    """Two threads generating with one streamed model: each forward runs whole before the other's, and
    both get the in-memory tokens."""
    model = stream_weights(build("gpt2", empty=True), gpt2["single"], BUDGET)
    seen: list[tuple[int, int]] = []
    for i, block in enumerate(model.transformer.h):
        block.attn.register_forward_hook(lambda *_, i=i: seen.append((threading.get_ident(), i)))
    results: dict[int, torch.Tensor] = {}

    def run(k: int) -> None:
        results[k] = generate(model)[0]

    run_threads([lambda k=k: run(k) for k in range(2)])
    assert all(torch.equal(results[k], gpt2["tokens"]) for k in range(2))
    for start in range(0, len(seen), 4):  # each forward: blocks 0..3, all from one thread
        run4 = seen[start:start + 4]
        assert [i for _, i in run4] == [0, 1, 2, 3] and len({t for t, _ in run4}) == 1, seen


# A real SIGINT, handled by Python's own handler (installed explicitly: a process started in the background
# by a non-interactive shell inherits SIGINT ignored), raised in the forward's own thread.
_SIGINT_CHILD = """
import signal
import sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests/support"]
from tests.offload.test_stream_errors import interrupted_forward
interrupted_forward(sys.argv[2], True)
"""


@pytest.mark.parametrize("real_signal", [False, True])
def test_ctrl_c_during_a_forward_leaves_the_model_usable(gpt2: dict, real_signal: bool) -> None:
    if not real_signal:
        interrupted_forward(str(gpt2["single"]), False)
        return
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _SIGINT_CHILD, root, str(gpt2["single"])], env=env,
                       capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def interrupted_forward(store: str, real_signal: bool) -> None:
    """Ctrl-C inside block 2 of a forward: the block's weights are placeholders again, and the model then
    generates exactly the in-memory tokens (the read-ahead restarts from block 0)."""
    ref = build("gpt2")
    want = generate(ref)[0]
    model = stream_weights(build("gpt2", empty=True), store, BUDGET)
    with torch.inference_mode():
        model(PROMPT)  # records the order: the interrupted forward below has reads ahead in flight
    fired = []

    def interrupt(*_: object) -> None:
        if not fired:
            fired.append(1)
            if real_signal:
                signal.raise_signal(signal.SIGINT)  # to this thread: handled before the hook returns
            else:
                raise KeyboardInterrupt

    hook = model.transformer.h[2].mlp.register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt), torch.inference_mode():
        model(PROMPT)
    hook.remove()
    assert fired and isinstance(model.transformer.h[2].mlp.c_fc.weight, Placeholder)
    got = generate(model)[0]
    if not torch.equal(got, want):
        raise AssertionError(f"after Ctrl-C: {got.tolist()} != {want.tolist()}")
    if stats(model)["resyncs"] < 1:
        raise AssertionError(f"the read-ahead did not restart: {stats(model)}")


def test_base_model_and_head_model_checkpoints_interchange(gpt2: dict, tmp_path: Path) -> None:
    """A base model (GPT2Model) streams from its head model's checkpoint and back: names are matched with
    and without the base model prefix, as from_pretrained does."""
    import transformers as tf

    from tests.offload.stream_models import config

    with torch.inference_mode():
        want = gpt2["model"].transformer(PROMPT).last_hidden_state
    with torch.device("meta"):
        base = tf.GPT2Model(config("gpt2")).eval()
    stream_weights(base, gpt2["single"], BUDGET)
    with torch.inference_mode():
        assert torch.equal(base(PROMPT).last_hidden_state, want)
    unstream(base)
    head = stream_weights(build("gpt2", empty=True), save(base, tmp_path / "base"), BUDGET)
    assert torch.equal(generate(head)[0], gpt2["tokens"])


def test_fifo_or_directory_instead_of_a_checkpoint(tmp_path: Path) -> None:
    """A FIFO named like a checkpoint is refused at once (never waited on), naming it."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file") as err:
        SafetensorsStore(fifo)
    assert err.value.filename == str(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        SafetensorsStore(tmp_path)  # the directory's model.safetensors is that FIFO


@pytest.mark.timeout(60)  # the defect was a hang: fail fast instead
def test_fifo_index_or_manifest_is_refused_not_waited_on(gpt2: dict, tmp_path: Path) -> None:
    """A FIFO named like the sharded index, the store manifest or its weights file: every entry point
    refuses it at once with an OSError naming it."""
    from deepnvme.offload import load_safetensors, open_store

    d = _copy(gpt2["sharded"], tmp_path / "sharded")
    index = d / "model.safetensors.index.json"
    index.unlink()
    os.mkfifo(index)
    for call in (lambda: open_store(d), lambda: SafetensorsStore(d), lambda: load_safetensors(d),
                 lambda: stream_weights(build("gpt2", empty=True), d, BUDGET)):
        with pytest.raises(OSError, match="not a regular file") as err:
            call()
        assert err.value.filename == str(index)
    target = tmp_path / "target"
    target.mkdir()
    os.mkfifo(target / "manifest.json")
    with pytest.raises(OSError, match="not a regular file") as err:
        write_store(gpt2["model"], target)
    assert err.value.filename == str(target / "manifest.json")
    assert os.listdir(target) == ["manifest.json"]  # nothing written beside it
    own = _copy(gpt2["own"], tmp_path / "own")
    weights = own / json.loads((own / "manifest.json").read_text())["file"]
    weights.unlink()
    os.mkfifo(weights)
    with pytest.raises(OSError, match="not a regular file") as err:
        open_store(own)
    assert err.value.filename == str(weights)


def test_own_store_with_a_bad_manifest_or_a_cut_file(gpt2: dict, tmp_path: Path) -> None:
    from deepnvme.offload import OwnStore

    d = _copy(gpt2["own"], tmp_path / "c")
    manifest = d / "manifest.json"
    good = manifest.read_text()
    weights = d / json.loads(good)["file"]
    os.truncate(weights, weights.stat().st_size - 8192)
    with pytest.raises(StoreError, match=rf"tensor .*'s data ends past byte \d+, the end of {weights}: "
                       "the file is truncated"):
        OwnStore(d)
    weights.unlink()
    with pytest.raises(FileNotFoundError) as err:
        OwnStore(d)
    assert err.value.filename == str(weights)
    manifest.write_text(good[:100])
    with pytest.raises(StoreError, match="not a readable deepnvme store manifest"):
        OwnStore(d)
    manifest.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(StoreError, match="not a deepnvme store manifest of version 1"):
        OwnStore(d)


def _edited_store(gpt2: dict, tmp_path: Path, edit: object) -> tuple[Path, Path]:
    """A copy of the own store whose manifest is edit(manifest); returns (directory, manifest path)."""
    d = _copy(gpt2["own"], tmp_path / "edited")
    manifest = d / "manifest.json"
    m = json.loads(manifest.read_text())
    edit(m)  # type: ignore[operator]
    manifest.write_text(json.dumps(m))
    return d, manifest


def _block_blob(m: dict) -> dict:
    return next(b for b in m["blobs"] if b["unit"] == "transformer.h.1")


def _same_offset(m: dict) -> None:
    first, second = _block_blob(m)["tensors"][:2]
    second["offset"] = first["offset"]


def _outside_blob(m: dict) -> None:
    b = _block_blob(m)
    b["tensors"][-1]["offset"] = b["offset"] + b["nbytes"]


def _wrong_nbytes(m: dict) -> None:
    t = _block_blob(m)["tensors"][0]
    t["nbytes"] -= 4


def _negative_offset(m: dict) -> None:
    _block_blob(m)["tensors"][0]["offset"] = -64


def _overlapping_blobs(m: dict) -> None:
    b = _block_blob(m)
    shift = b["offset"] - m["blobs"][0]["offset"]
    b["offset"] -= shift
    for t in b["tensors"]:
        t["offset"] -= shift


@pytest.mark.parametrize(("edit", "match"), [
    (_same_offset, r"tensors 'transformer\.h\.1\..*' and 'transformer\.h\.1\..*' overlap"),
    (_outside_blob, r"tensor 'transformer\.h\.1\..*' in .*manifest\.json: bytes .* lie outside its blob"),
    (_wrong_nbytes, r"tensor 'transformer\.h\.1\..*' in .*manifest\.json: the manifest gives \d+ bytes"),
    (_negative_offset, r"tensor 'transformer\.h\.1\..*' in .*manifest\.json: 'offset' is -64"),
    (_overlapping_blobs, r"manifest\.json: blobs unit .* and unit .* overlap"),
])
def test_own_store_manifest_claims_are_checked_when_opened(gpt2: dict, tmp_path: Path, edit: object,
                                                           match: str) -> None:
    """Every claim of the manifest is checked when the store opens: two tensors on the same bytes, a
    tensor outside its blob or with the wrong length never reach a forward (the CRCs are each tensor's
    own and would not catch two tensors read from one place)."""
    d, _ = _edited_store(gpt2, tmp_path, edit)
    with pytest.raises(StoreError, match=match):
        stream_weights(build("gpt2", empty=True), d, BUDGET)


def _pop(key: str) -> object:
    def edit(m: dict) -> None:
        t = _block_blob(m)["tensors"][0]
        (t if key in t else _block_blob(m)).pop(key)
    return edit


def _set(where: str, key: str, value: object) -> object:
    def edit(m: dict) -> None:
        target = {"manifest": m, "blob": _block_blob(m), "tensor": _block_blob(m)["tensors"][0]}[where]
        target[key] = value
    return edit


@pytest.mark.parametrize(("edit", "match"), [
    (_pop("shape"), r"tensor '.*' in .*manifest\.json: 'shape' None is not a list"),
    (_pop("crc"), r"tensor '.*' in .*manifest\.json: 'crc' is None"),
    (_pop("tensors"), r"manifest\.json: blob \d+ \(unit 'transformer\.h\.1'\): 'tensors' is missing"),
    (_pop("names"), r"manifest\.json: blob \d+ \(unit 'transformer\.h\.1'\): .*'names' None"),
    (_set("tensor", "shape", "abc"), r"tensor '.*' in .*manifest\.json: 'shape' 'abc' is not a list"),
    (_set("tensor", "offset", "12"), r"tensor '.*' in .*manifest\.json: 'offset' is '12'"),
    (_set("tensor", "dtype", 7), r"tensor '.*' in .*manifest\.json: unknown dtype 7"),
    (_set("blob", "nbytes", 1.5), r"manifest\.json: blob \d+ \(unit 'transformer\.h\.1'\): 'nbytes' is 1\.5"),
    (_set("blob", "tensors", [5]), r"manifest\.json: blob \d+ .*: a tensor entry is a int"),
    (_set("manifest", "blobs", 5), r"manifest\.json: 'blobs' is a int, not a list"),
    (_set("manifest", "blobs", ["x"]), r"manifest\.json: blob 0 \(unit None\): is a str"),
])
def test_own_store_malformed_manifest_is_a_store_error(gpt2: dict, tmp_path: Path, edit: object,
                                                       match: str) -> None:
    """A key missing or of the wrong type is a StoreError naming the manifest and the entry, never a raw
    KeyError or TypeError."""
    from deepnvme.offload import open_store

    d, _ = _edited_store(gpt2, tmp_path, edit)
    with pytest.raises(StoreError, match=match):
        open_store(d)


@pytest.mark.parametrize("which", ["block", "resident"])
def test_store_dtype_of_another_kind_is_refused(gpt2: dict, tmp_path: Path, which: str) -> None:
    """An I32 header entry for an F32 parameter (same size, so every length check passes) is refused,
    naming the tensor and the file, for a streamed block tensor and a resident one alike; a float
    conversion (bf16 checkpoint, fp32 model) stays allowed."""
    from deepnvme.offload import load_safetensors

    d = _copy(gpt2["single"], tmp_path / "c")
    file = d / "model.safetensors"
    name = ""

    def edit(header: dict) -> None:
        nonlocal name
        name = _name_of_block_weight(header) if which == "block" else "transformer.wte.weight"
        header[name]["dtype"] = "I32"
    _rewrite_header(file, edit)
    with pytest.raises(StoreError, match=rf"tensor '{name}' in {file}: torch.int32 \(integer\) in the store, "
                       r"torch.float32 \(floating\)"):
        stream_weights(build("gpt2", empty=True), d, BUDGET)
    half = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_safetensors(
        gpt2["single"]).items()}
    import safetensors.torch

    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    safetensors.torch.save_file(half, bf16 / "model.safetensors")
    model = stream_weights(build("gpt2", empty=True), bf16, BUDGET)
    with torch.inference_mode():
        assert model(PROMPT).logits.dtype == torch.float32


def test_store_of_a_larger_model_warns_naming_the_unused_tensors(gpt2: dict, tmp_path: Path) -> None:
    """A 6-block checkpoint for a 4-block model streams (the first four blocks are the model's), with a
    warning counting the store tensors that fill nothing and naming a few; a matching store warns not."""
    import transformers as tf

    from tests.offload.stream_models import config

    torch.manual_seed(1)
    big = tf.GPT2LMHeadModel(tf.GPT2Config(**{**config("gpt2").to_dict(), "n_layer": 6})).eval()
    d = save(big, tmp_path / "big")
    extra = [n for n in big.state_dict() if n.startswith(("transformer.h.4.", "transformer.h.5."))]
    with pytest.warns(UserWarning, match=rf"{len(extra)} tensors of the store {d} fill nothing in the model "
                      r"and are not read: 'transformer\.h\.4\..*' and \d+ more"):
        stream_weights(build("gpt2", empty=True), d, BUDGET)
    import warnings

    for store in ("single", "sharded", "own"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            unstream(stream_weights(build("gpt2", empty=True), gpt2[store], BUDGET))


def test_budget_bytes_bounds_and_integral_types(gpt2: dict) -> None:
    """An absurd budget is refused naming budget_bytes (not a pybind TypeError); numpy integers are taken
    as ints, a bool is not."""
    import numpy as np

    from deepnvme.offload import load_safetensors

    model = build("gpt2", empty=True)
    for call in (lambda b: stream_weights(model, gpt2["own"], b), lambda b: load_safetensors(gpt2["single"],
                                                                                           budget_bytes=b)):
        with pytest.raises(ValueError, match=r"budget_bytes=1180591620717411303424 is more than this "
                                             r"machine's memory"):
            call(2**70)
        with pytest.raises(TypeError, match="budget_bytes must be an int, got bool"):
            call(True)
    want = load_safetensors(gpt2["single"])
    got = load_safetensors(gpt2["single"], budget_bytes=np.int64(BUDGET))
    assert all(torch.equal(got[k], want[k]) for k in want)
    streamed = stream_weights(model, gpt2["own"], np.int64(BUDGET))
    assert torch.equal(generate(streamed)[0], gpt2["tokens"])


def test_load_safetensors_messages(gpt2: dict) -> None:
    """A budget of one page cannot hold an unaligned piece: the error names a tensor, its file and the
    bytes to ask for; a budget of 0 is refused by name. A deepnvme store directory is named as one, with
    the calls that read it."""
    from deepnvme.offload import load_safetensors

    file = gpt2["single"] / "model.safetensors"
    with pytest.raises(ValueError, match=rf"tensor '.*' in {file} is read in pieces .* over "
                                         r"budget_bytes=4096: raise budget_bytes to at least 8192"):
        load_safetensors(gpt2["single"], budget_bytes=4096)
    with pytest.raises(ValueError, match="budget_bytes"):
        load_safetensors(gpt2["single"], budget_bytes=0)
    with pytest.raises(FileNotFoundError, match="it is a deepnvme store .*stream_weights.*open_store"):
        load_safetensors(gpt2["own"])


def test_load_of_a_file_cut_short(gpt2: dict, tmp_path: Path) -> None:
    """A checkpoint cut short after its header was read: the load refuses before reading, naming the file
    and the bytes that lie past its end."""
    from deepnvme.offload import SafetensorsStore
    from deepnvme.offload.infer import read_store

    d = _copy(gpt2["single"], tmp_path / "c")
    store = SafetensorsStore(d)
    os.truncate(d / "model.safetensors", (d / "model.safetensors").stat().st_size // 2)
    with pytest.raises(ValueError, match=rf"lie past the end of {d / 'model.safetensors'}"):
        read_store(store, list(store.tensors()), torch.device("cpu"), 64 << 20)


def test_a_block_called_alone_before_the_first_forward_is_not_recorded(gpt2: dict) -> None:
    """The read order is recorded inside a forward of the whole model only: a block run on its own first
    (a caller probing one layer) does not become part of it, so the read-ahead follows 0, 1, 2, 3."""
    model = stream_weights(build("gpt2", empty=True), gpt2["own"], BUDGET)
    with torch.inference_mode():
        model.transformer.h[3](torch.zeros(1, len(PROMPT[0]), 64))
        model(PROMPT)
    assert model._deepnvme_stream.order == [0, 1, 2, 3]
    assert torch.equal(generate(model)[0], gpt2["tokens"])
    assert stats(model)["resyncs"] == 0
