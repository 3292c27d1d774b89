"""ds_io: argument validation and exit codes, the JSON record, every engine on a small size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepnvme.tools import ds_io
from deepnvme.tools.sizes import format_size, parse_size

ROOT = Path(__file__).resolve().parents[2]
SIZE = "4M"
RESULT_KEYS = {"op", "engine", "io_engine", "processes", "io_size", "loops", "warmup_loops", "block_size",
               "queue_depth", "single_submit", "overlap_events", "intra_op_parallelism", "page_cache",
               "task_latency_s", "task_speed_gb_s", "e2e_latency_s", "e2e_speed_gb_s",
               "request_latency_p50_s", "request_latency_p99_s", "requests", "cpu_seconds",
               "cpu_seconds_per_gib", "cpu_percent_of_one_core", "tool"}


@pytest.fixture
def folder(tmp_path: Path) -> str:
    """The test's own directory (whatever its file system, ds_io says how reads avoid the cache)."""
    return str(tmp_path)


def run_main(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """ds_io.main in this process: (exit status, stdout, stderr)."""
    try:
        rc = ds_io.main(args)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_sizes() -> None:
    assert parse_size("4K") == 4096 and parse_size("1M") == 1 << 20 and parse_size("2G") == 2 << 30
    assert parse_size("1.5K") == 1536 and parse_size("512") == 512
    assert format_size(1 << 20) == "1M" and format_size(1536) == "1536"
    for bad in ("", "4X", "-1", "0", "M"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize("args, names", [
    ([], ["--folder"]),
    (["--folder", "/nonexistent/dir"], ["--folder"]),
    (["--engine", "nope"], ["--engine"]),
    (["--io_engine", "nope"], ["--io_engine"]),
    (["--loops", "0"], ["--loops"]),
    (["--queue_depth", "0"], ["--queue_depth"]),
    (["--io_parallel", "0"], ["--io_parallel"]),
    (["--multi_process", "0"], ["--multi_process"]),
    (["--use_gds"], ["--use_gds"]),
    (["--folder_to_device_mapping", "nocolon"], ["--folder_to_device_mapping"]),
    (["--folder_to_device_mapping", "/tmp:x"], ["--folder_to_device_mapping"]),
    (["--engine", "torch_fastio", "--torch_legacy_save", "--fast_io_size", "4K"], ["--fast_io_size"]),
])
def test_invalid_arguments_exit_2_naming_them(args: list[str], names: list[str], folder: str,
                                               capsys: pytest.CaptureFixture) -> None:
    base = ["--io_size", SIZE]
    if "--folder" not in args and "--folder_to_device_mapping" not in args and args:
        base += ["--folder", folder]
    rc, _, err = run_main(base + args, capsys)
    assert rc == 2
    assert "validation error" in err
    for name in names:
        assert f"argument {name}" in err


def test_both_folder_forms_rejected(folder: str, capsys: pytest.CaptureFixture) -> None:
    rc, _, err = run_main(["--io_size", SIZE, "--folder", folder, "--folder_to_device_mapping",
                           f"{folder}:0"], capsys)
    assert rc == 2 and "argument --folder" in err


@pytest.mark.parametrize("bad", ["4X", "0", "-4M"])
def test_bad_size_exit_2(bad: str, folder: str, capsys: pytest.CaptureFixture) -> None:
    rc, _, err = run_main(["--folder", folder, "--io_size", bad], capsys)
    assert rc == 2 and "--io_size" in err


def test_gpu_without_cuda_exit_2(folder: str, capsys: pytest.CaptureFixture) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, _, err = run_main(["--folder", folder, "--io_size", SIZE, "--gpu"], capsys)
    assert rc == 2 and "argument --gpu" in err and "CUDA" in err
    rc, _, err = run_main(["--folder", folder, "--io_size", SIZE, "--gpu", "--use_gds"], capsys)
    assert rc == 2 and "argument --gpu" in err


@pytest.mark.parametrize("engine", ds_io.ENGINES)
@pytest.mark.parametrize("read", [False, True], ids=["write", "read"])
def test_every_engine_small(engine: str, read: bool, folder: str, capsys: pytest.CaptureFixture) -> None:
    args = ["--folder", folder, "--io_size", SIZE, "--engine", engine, "--loops", "2", "--validate"]
    rc, out, err = run_main(args + (["--read"] if read else []), capsys)
    assert rc == 0, err
    op = "Read" if read else "Write"
    for line in (f"Task {op} Latency = ", f"Task {op} Speed = ", f"E2E {op} Latency = ",
                 f"E2E {op} Speed = "):
        hits = [ln for ln in out.splitlines() if ln.startswith(line)]
        assert len(hits) == 1, out
        value = float(hits[0].split()[-2])  # DeepSpeed's parser takes the second-to-last token
        assert value > 0
    assert "Page cache:" in out and f"Request {op} Latency p50" in out and "CPU = " in out
    if not read:  # write files are removed after the run
        assert not [f for f in os.listdir(folder) if "_write_" in f]


def test_torch_fastio_legacy_stream(folder: str, capsys: pytest.CaptureFixture) -> None:
    """torch.save's non-zip stream through FastFileWriter in a 64 KiB buffer: many halves, file checked."""
    args = ["--folder", folder, "--io_size", SIZE, "--engine", "torch_fastio", "--torch_legacy_save",
            "--fast_io_size", "64K", "--loops", "2", "--validate"]
    rc, out, err = run_main(args, capsys)
    assert rc == 0, err
    assert "Task Write Speed = " in out


@pytest.mark.parametrize("io_engine", ["posix", "libaio", "io_uring"])
def test_json_record(io_engine: str, folder: str, capsys: pytest.CaptureFixture) -> None:
    from deepnvme import AsyncIOBuilder

    if io_engine not in AsyncIOBuilder().load().available_engines():
        pytest.skip(f"{io_engine} unavailable here")
    rc, out, err = run_main(["--folder", folder, "--io_size", SIZE, "--io_engine", io_engine, "--json",
                             "--read", "--loops", "3", "--io_parallel", "2"], capsys)
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, "stdout must carry the JSON record only"
    rec = json.loads(lines[0])
    assert set(rec) == RESULT_KEYS
    assert rec["op"] == "read" and rec["io_engine"] == io_engine and rec["io_size"] == 4 << 20
    assert rec["requests"] == 3 and rec["intra_op_parallelism"] == 2 and rec["overlap_events"] is True
    assert rec["page_cache"] in ("O_DIRECT", "fadvise", "cached")
    assert rec["request_latency_p50_s"] <= rec["request_latency_p99_s"]
    assert "E2E Read Speed" in err  # the readable lines moved to stderr


def test_multi_process_real_processes(folder: str) -> None:
    """Two spawned processes through the launcher in bin/ (its __main__ guard matters under spawn)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bin" / "ds_io"), "--folder", folder, "--io_size", SIZE,
                           "--multi_process", "2", "--json", "--loops", "1"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    assert rec["processes"] == 2 and rec["requests"] == 2
    assert "[1]: process 1 <----> " in proc.stderr


def test_io_engine_is_an_argument_not_the_environment(folder: str, capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """--io_engine reaches aio_basic's calls as an argument: the run reports that engine and leaves
    DEEPNVME_ENGINE untouched for whatever runs next in the process."""
    monkeypatch.delenv("DEEPNVME_ENGINE", raising=False)
    rc, out, err = run_main(["--folder", folder, "--io_size", SIZE, "--engine", "aio_basic", "--io_engine",
                             "posix", "--json", "--loops", "1", "--validate"], capsys)
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["io_engine"] == "posix"
    assert "DEEPNVME_ENGINE" not in os.environ
