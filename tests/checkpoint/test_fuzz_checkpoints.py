"""A fuzzer of our own for the checkpoint readers: hypothesis mutates valid deepnvme.save, torch.save and
DCP files (bit flips, truncations, splices, edits of zip header fields) and a child process loads each with
stock torch / DCP and with deepnvme (see tests/support/fuzz_worker.py).

Allowed outcomes for deepnvme: the very objects stock loads (same tensors, bytes, dtypes, shapes, strides,
and the same storage sharing), or a CheckpointFormatError naming the file, or an OSError with errno and
the file's path. Never: a crash of the child, a hang, MemoryError (the child runs under an address-space
limit of 1 GiB above its start-up size), an object that differs from stock's, an object where stock
raised, or any other exception.

Examples per archive base: DEEPNVME_FUZZ_EXAMPLES (default 10; a DCP base gets half as many, each of
its examples loading a whole checkpoint twice), a few seconds each in CI; e.g.
`DEEPNVME_FUZZ_EXAMPLES=5000 python3 -m pytest tests/checkpoint/test_fuzz_checkpoints.py` for a long run.
"""

from __future__ import annotations

import io
import json
import os
import selectors
import shutil
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zipcraft
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemWriter

import deepnvme
from deepnvme.checkpoint import AioStorageWriter

EXAMPLES = int(os.environ.get("DEEPNVME_FUZZ_EXAMPLES", "10"))
REPLY_SECONDS = 120  # far beyond any one load of these small files, even on a loaded machine: a hang
REPO = Path(__file__).resolve().parents[2]
SUPPORT = REPO / "tests" / "support"
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 100,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FUZZ_DCP = settings(FUZZ, max_examples=max(1, EXAMPLES // 2))


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    big = torch.randn(20_000, generator=g)  # a payload the prefetch reads into a storage of its own
    return {"big": big, "view": big[10:20], "small": torch.arange(7, dtype=torch.int16),
            "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16), "flag": torch.tensor(True),
            "step": 3, "name": "x", "nested": {"t": torch.ones(2, 2), "l": [1, 2.5]}}


class Worker:
    """The fuzz child: one request (a file to load both ways) at a time, answers within REPLY_SECONDS."""

    def __init__(self, template: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        # DCP logs every refused load with its traceback: kept in a file, shown when the child dies.
        self.log = template.with_name("fuzz-worker.log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(SUPPORT / "fuzz_worker.py"),
                                          str(template)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, text=True, env=env)
        self._select = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._select.register(self.proc.stdout, selectors.EVENT_READ)
        assert self._reply() == {"ready": True}

    def _reply(self) -> Any:
        assert self.proc.stdout is not None
        if not self._select.select(REPLY_SECONDS):
            self.proc.kill()
            pytest.fail(f"the fuzz child gave no answer in {REPLY_SECONDS} s: a load hangs")
        line = self.proc.stdout.readline()
        if not line:
            tail = self.log.read_text()[-3000:]
            pytest.fail(f"the fuzz child died (exit status {self.proc.wait()}): a load crashed it\n{tail}")
        return json.loads(line)

    def load(self, kind: str, path: Path) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"kind": kind, "path": str(path)}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The valid files mutated: two archives and two DCP checkpoints (stock's writer and ours)."""
    root = tmp_path_factory.mktemp("fuzz-bases")
    state = _state()
    torch.save(state, root / "template.pt")
    deepnvme.save(state, root / "deepnvme.pt")
    torch.save(state, root / "torch.pt")
    out: dict[str, Any] = {"root": root, "template": root / "template.pt"}
    for name in ("deepnvme", "torch"):
        out[name] = (root / f"{name}.pt").read_bytes()
    tensors = {k: v for k, v in state.items() if k != "view"}  # DCP saves views as their own tensors
    for name, writer in (("dcp-stock", FileSystemWriter), ("dcp-ours", AioStorageWriter)):
        dcp.save(tensors, storage_writer=writer(root / name), no_dist=True)
        out[name] = root / name
    torch.save(tensors, root / "template-dcp.pt")
    return out


@pytest.fixture(scope="module")
def worker(bases: dict[str, Any]) -> Iterator[Worker]:
    w = Worker(bases["root"] / "template-dcp.pt")
    yield w
    w.close()


def _fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of the zip header fields of every archive in `data` (a .distcp file holds one per
    item, back to back): local headers, central entries, end records."""
    out: list[tuple[int, int]] = []
    local = [(4, 2), (6, 2), (8, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2)]
    central = [(8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2), (42, 4)]
    end = data.find(zipcraft.END)
    while end >= 0:
        archive = data[:end + 22]  # zipfile places an archive found after other bytes by its end record
        try:
            entries = zipcraft.entries(archive)
        except Exception:  # noqa: BLE001 - an end record zipfile cannot follow still gets flips and cuts
            entries = []
        for e in entries:
            out += [(e.header_offset + o, w) for o, w in local] + [(e.at + o, w) for o, w in central]
        out += [(end + o, w) for o, w in [(8, 2), (10, 2), (12, 4), (16, 4)]]
        end64 = archive.rfind(zipcraft.END64)
        if end64 >= 0:
            out += [(end64 + o, 8) for o in (24, 32, 40, 48)]
        end = data.find(zipcraft.END, end + 4)
    return [(o, w) for o, w in out if 0 <= o and o + w <= len(data)]


@st.composite
def mutations(draw: st.DrawFn, data: bytes, others: list[bytes]) -> bytes:
    """1 to 3 edits of `data`: bit flips, a cut, a splice from a base file, a header field set."""
    out = bytearray(data)
    fields = _fields(data)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "cut", "splice", "field", "field"] if fields else
                                    ["flip", "cut", "splice"]))
        if not out:
            break
        if kind == "flip":
            at = draw(st.integers(0, len(out) - 1))
            out[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            out = out[:draw(st.integers(0, len(out) - 1))]
        elif kind == "splice":
            source = draw(st.sampled_from([bytes(out), *others]))
            a = draw(st.integers(0, len(source) - 1))
            n = draw(st.integers(1, min(4096, len(source) - a)))
            b = draw(st.integers(0, len(out)))
            out[b:b + n] = source[a:a + n]
        else:
            at, width = draw(st.sampled_from(fields))
            if at + width > len(out):
                continue
            old = int.from_bytes(out[at:at + width], "little")
            top = (1 << (8 * width)) - 1
            value = draw(st.sampled_from([0, 1, top, old + 1, old - 1, old + 4096, old - 4096, len(data),
                                          len(data) + 1])) & top
            value = draw(st.one_of(st.just(value), st.integers(0, top)))
            out[at:at + width] = value.to_bytes(width, "little")
    return bytes(out)


def _judge(answer: dict[str, Any], path: Path, stocks_verdict_stands: bool = False) -> None:
    """Fail unless every deepnvme outcome in `answer` is an allowed one (see the module). With
    `stocks_verdict_stands` (DCP), an error identical to stock's also passes: DCP's own planner checks the
    metadata against the state dict (a mutated shape: "Size mismatch ...") before any reader is asked."""
    stock = answer["stock"]
    for ours in answer["ours"]:
        if stocks_verdict_stands and "error" in ours and "error" in stock and \
                (ours["error"], ours["text"]) == (stock["error"], stock["text"]):
            continue
        if "ok" in ours:
            assert "ok" in stock, f"deepnvme loaded what stock refuses ({stock})"
            assert ours["ok"] == stock["ok"], "deepnvme loaded other objects than stock"
            continue
        mro = ours["mro"]
        assert "MemoryError" not in mro, f"a load needed memory far beyond the file's size: {ours}"
        if "CheckpointFormatError" in mro:
            assert ours["filename"] == str(path) or str(path) in ours["filename"], ours
        elif "OSError" in mro:
            assert ours["errno"] is not None and ours["filename"] and str(path) in ours["filename"], ours
        else:
            pytest.fail(f"deepnvme raised {ours['error']}, neither CheckpointFormatError nor OSError: {ours}")


@pytest.mark.parametrize("base", ["deepnvme", "torch"])
def test_mutated_archives(bases: dict[str, Any], worker: Worker, base: str, tmp_path: Path) -> None:
    data: bytes = bases[base]
    others = [bases[b] for b in ("deepnvme", "torch") if b != base]

    @FUZZ
    @given(mutated=mutations(data, others))
    def case(mutated: bytes) -> None:
        path = tmp_path / "fuzzed.pt"
        path.write_bytes(mutated)
        _judge(worker.load("zip", path), path)

    case()


@pytest.mark.parametrize("base", ["dcp-stock", "dcp-ours"])
def test_mutated_dcp_checkpoints(bases: dict[str, Any], worker: Worker, base: str, tmp_path: Path) -> None:
    source: Path = bases[base]
    data_file = next(p.name for p in source.iterdir() if p.suffix == ".distcp")
    files = {name: (source / name).read_bytes() for name in (data_file, ".metadata")}

    @FUZZ_DCP
    @given(which=st.sampled_from([data_file, data_file, data_file, ".metadata"]), data=st.data())
    def case(which: str, data: st.DataObject) -> None:
        directory = tmp_path / "fuzzed"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir()
        others = [files[n] for n in files if n != which]
        for name, content in files.items():
            edited = data.draw(mutations(content, others)) if name == which else content
            (directory / name).write_bytes(edited)
        _judge(worker.load("dcp", directory), directory, stocks_verdict_stands=True)

    case()


def test_the_oracle_sees_a_difference() -> None:
    """The judge itself: a load that differs from stock's, or an error of another type, fails it."""
    path = Path("/x.pt")
    same = {"ok": ["value", "1"]}
    with pytest.raises(AssertionError, match="other objects"):
        _judge({"stock": same, "ours": [{"ok": ["value", "2"]}]}, path)
    with pytest.raises(AssertionError, match="stock refuses"):
        _judge({"stock": {"error": "RuntimeError"}, "ours": [same]}, path)
    with pytest.raises(pytest.fail.Exception, match="neither"):
        _judge({"stock": same, "ours": [{"error": "RuntimeError", "mro": ["RuntimeError"]}]}, path)
    _judge({"stock": same, "ours": [{"error": "X", "mro": ["CheckpointFormatError"], "filename": str(path)}]},
           path)
    assert struct and io  # noqa: PT018 - modules the strategies use
