"""bench/stream_bench.py end to end at its smallest (--tiny: a 1 MiB budget, one repeat, two tokens; the MoE
and the Llama, as each model costs about 20 s of CI in child processes: the dense GPT-2, with its tied head,
is streamed by tests/offload's own tests): every contender runs in its own process and cgroup, decodes the
in-memory model's tokens, and the report holds every row the issue asks for. Nothing here is timed: the
figures of a tiny run mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

for extra in ("transformers", "accelerate", "safetensors"):  # the offload extras (pyproject.toml)
    pytest.importorskip(extra)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import stream_bench  # noqa: E402

CONTENDERS = {"deepnvme-store", "deepnvme-one-call", "accelerate", "memory"}
MODELS = ("moe", "llama")


def our_cgroups() -> set[str]:
    if not stream_bench.CGROUP_V1.is_dir():
        return set()
    return {p.name for p in stream_bench.CGROUP_V1.iterdir() if p.name.startswith("deepnvme-streambench-")}


def test_tiny_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "res" / "stream"
    use_cgroup = stream_bench.MemoryCgroup.available() is None
    before = our_cgroups()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, str(ROOT / "bench" / "stream_bench.py"), "--tiny", "--workdir",
           str(tmp_path / "wd"), "--rest", "0", "--out", str(out), "--models", ",".join(MODELS),
           *([] if use_cgroup else ["--no_cgroup"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert {a["model"] for a in data["analyses"]} == set(MODELS)
    for name, per in data["samples"].items():
        assert set(per) == CONTENDERS, name
        for contender, samples in per.items():
            assert len(samples) == 1 and "error" not in samples[0], (name, contender, samples)
            s = samples[0]
            assert [r["batch"] for r in s["runs"]] == [1, 16]
            for r in s["runs"]:
                assert len(r["step_s"]) == 2 and r["tokens_per_s"] > 0
                assert len(r["tokens"]) == r["batch"] and len(r["tokens"][0]) == 3  # warm-up + 2 steps
            assert s["peak_rss"] > 0
            if use_cgroup:
                assert s["cgroup_peak"] > 0 and s["oom_kills"] == 0
                assert s["limit"] == (None if contender == "memory" else (256 << 10) + (1 << 30))
    for a in data["analyses"]:
        for b, cell in a["batches"].items():
            assert cell["tokens_match"] == dict.fromkeys(CONTENDERS - {"memory"}, True), (a["model"], b)
            assert cell["bound"] > 0 and cell["ceiling"] > 0
            assert all(r["first_token_s"] > 0 for r in cell["rows"].values())
            for n in ("deepnvme-store", "deepnvme-one-call"):
                assert cell["rows"][n]["bytes_per_step"] > 0
                assert f"{n} / accelerate" in cell["ratios"]
            if a["model"] == "moe":
                assert cell["rows"]["deepnvme-store"]["hit_rate"] is not None
                if b == 1:  # the routed reads were recorded and replayed alone (stream_child.RoutedReads)
                    assert cell["rows"]["deepnvme-store"]["replay_s"] > 0
                    assert set(cell["limits"]) == {"routed reads alone",
                                                   "routed reads, then the in-memory compute, in series"}
    for run in data["samples"]["moe"]["deepnvme-store"][0]["runs"]:
        replay = run["routed_replay"]
        if run["batch"] == 1:  # exactly the expert bytes the cache read over the timed steps, replayed
            assert "error" not in replay, replay
            assert replay["bytes"] == run["stats"]["experts.bytes_read"] > 0 and replay["seconds"] > 0
        else:
            assert replay is None
    assert data["samples"]["moe"]["deepnvme-one-call"][0]["runs"][0]["routed_replay"] is None
    assert data["load"]["vs_raw"] > 0 and data["load"]["vs_load_file"] > 0
    assert data["drive"] and all(len(v) == len(MODELS) for v in data["drive"].values())  # one per model heat
    report = out.with_suffix(".md").read_text()
    assert "## Targets (issues 20 and 38)" in report
    assert "llama, batch 1, deepnvme-one-call / accelerate (issue 38)" in report
    assert "moe, batch 16, deepnvme-one-call / accelerate (issue 38)" in report
    assert "load_safetensors / raw read of the same bytes" in report
    assert "I/O bound" in report and "DIFFER" not in report and "limit: routed reads alone" in report
    assert our_cgroups() == before  # every cgroup it made is gone
    assert not (tmp_path / "wd" / "bound.bin").exists()
    built = sorted(p.name for p in (tmp_path / "wd").iterdir())
    # the models and stores stay for the next run, which reuses them without building
    for spec in stream_bench.TINY.values():
        d = tmp_path / "wd" / f"{spec.name}-{spec.key()}"
        assert d.name in built
        stamp = (d / "built.json").stat().st_mtime_ns
        assert stream_bench.build_model(spec, tmp_path / "wd", print) == d
        assert (d / "built.json").stat().st_mtime_ns == stamp


def test_cgroup_command_joins_before_exec() -> None:
    group = stream_bench.MemoryCgroup.__new__(stream_bench.MemoryCgroup)
    group.path = Path("/sys/fs/cgroup/memory/x")
    argv = group.wrap(["python3", "-c", "print('a b')"])
    assert argv[:2] == ["sh", "-c"] and "exec" in argv[2] and argv[3] == str(group.path)
    assert argv[4:] == ["python3", "-c", "print('a b')"]


@pytest.mark.skipif(stream_bench.MemoryCgroup.available() is not None, reason="no writable memory cgroup v1")
def test_cgroup_limit_is_enforced_and_removed() -> None:
    group = stream_bench.MemoryCgroup(f"deepnvme-streambench-test-{os.getpid()}", 64 << 20)
    try:
        assert int((group.path / "memory.limit_in_bytes").read_text()) == 64 << 20
        proc = subprocess.run(group.wrap([sys.executable, "-c", "b = bytearray(256 << 20); b[::4096] = "
                                          "b'x' * len(b[::4096]); print('survived')"]),
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode != 0 and "survived" not in proc.stdout
        assert group.oom_kills() >= 1 and group.peak() >= 32 << 20
    finally:
        group.remove()
    assert not group.path.exists()


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture) -> None:
    for bad in (["--models", "dense,huge"], ["--sections", "decode,colour"], ["--budget", "lots"],
                ["--repeats", "0"]):
        with pytest.raises(SystemExit) as exc:
            stream_bench.parse_args([*bad, "--no_cgroup"])
        assert exc.value.code == 2
    assert "--models" in capsys.readouterr().err
