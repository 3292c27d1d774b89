"""ds_nvme_tune: argument checks, the sweep_config parser, and a tiny search whose config builds a handle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepnvme.tools import tune


def run_main(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """tune.main in this process: (exit status, stdout, stderr)."""
    try:
        rc = tune.main(args)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("args, name", [
    (["--nvme_dir", "/nonexistent/dir"], "--nvme_dir"),
    (["--io_size", "4X"], "--io_size"),
    (["--loops", "0"], "--loops"),
    (["--time_budget", "0"], "--time_budget"),
    (["--no_read", "--no_write"], "--no_read"),
    (["--gds"], "--gds"),
    (["--engine", "nope"], "--engine"),
    (["--sweep_config", "{not json"], "--sweep_config"),
    (["--sweep_config", '{"colour": [1]}'], "--sweep_config"),
    (["--sweep_config", '{"queue_depth": [0]}'], "--sweep_config"),
])
def test_bad_arguments_exit_2(args: list[str], name: str, tmp_path: Path,
                              capsys: pytest.CaptureFixture) -> None:
    base = [] if "--nvme_dir" in args else ["--nvme_dir", str(tmp_path)]
    rc, _, err = run_main(base + args + ["--log_dir", str(tmp_path / "logs")], capsys)
    assert rc == 2 and f"argument {name}" in err


def test_gpu_without_cuda_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, _, err = run_main(["--nvme_dir", str(tmp_path), "--gpu"], capsys)
    assert rc == 2 and "argument --gpu" in err


def test_parse_sweep_deepspeed_names() -> None:
    space = tune.parse_sweep('{"block_size": ["1M", "8M"], "queue_depth": [32, 128], '
                             '"sequential_requests": [true, "false"], "io_parallel": [1, 2], '
                             '"folder_to_device_mapping": ["/x:0"]}', ["posix"])
    assert space == {"block_size": [1 << 20, 8 << 20], "queue_depth": [32, 128],
                     "overlap_events": [False, True], "intra_op_parallelism": [1, 2]}


def test_tiny_search_config_builds_a_handle(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from deepnvme import AsyncIOBuilder

    logs = tmp_path / "logs"
    rc, out, err = run_main(["--nvme_dir", str(tmp_path), "--io_size", "1M", "--log_dir", str(logs),
                             "--sweep_config", '{"block_size": ["256K", "1M"], "queue_depth": [4, 16]}',
                             "--no_fio", "--time_budget", "600", "--json"], capsys)
    assert rc == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    config = rec["config"]
    assert set(config) == set(tune.KEYS)
    assert isinstance(config["single_submit"], bool) and isinstance(config["overlap_events"], bool)
    assert config["block_size"] in (256 << 10, 1 << 20) and config["queue_depth"] in (4, 16)
    assert set(rec["aio"]) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                               "overlap_events"}
    # Far more budget than it needs: the search ends by itself, the four points then three rounds of
    # re-measuring them, however slow the machine (the budget's rule: test_search_keeps_to_its_budget).
    assert rec["measurements"] == 4 + 3 * 4 and rec["seconds"] > 0
    # The printed configuration is accepted as is, and the handle it makes moves data.
    import torch

    handle = AsyncIOBuilder().load().aio_handle(**config)
    data = torch.arange(1 << 16, dtype=torch.int32)
    back = torch.empty_like(data)
    path = str(tmp_path / "check.bin")
    handle.sync_pwrite(data, path)
    handle.sync_pread(back, path)
    assert torch.equal(data, back)
    assert json.loads((logs / "best_config.json").read_text()) == config
    results = json.loads((logs / "results.json").read_text())
    assert len(results["results"]) == rec["measurements"]
    assert (logs / "tune.log").read_text().count("GB/sec") == rec["measurements"]
    assert '"aio": {' in err and "Best performance (GB/sec): read = " in err
    assert not list(tmp_path.glob("_deepnvme_tune*"))  # the tuner's files are removed


def test_search_keeps_to_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """No measurement starts once the budget left is under the mean cost of one, checked on a clock the
    test moves (each measurement costs 3 s of it) rather than on a machine's speed: with 10 s, three
    measurements (the fourth would start with 1 s left), and the best of them wins."""
    from types import SimpleNamespace

    from deepnvme.tools.tune import search

    now = [0.0]
    monkeypatch.setattr(search, "time", SimpleNamespace(monotonic=lambda: now[0]))

    class ThreeSecondBench:
        """Stands in for the drive: the search's arithmetic is under test here, not the I/O."""

        def measure(self, config: dict, floor: float = 0.0) -> dict:
            now[0] += 3.0
            return {"read": 1.0, "score": config["queue_depth"] / 8, "engine": "posix"}

    s = search.Search(ThreeSecondBench(), {"queue_depth": [4, 8, 16, 32]}, 10.0, lambda _line: None, True)
    config, med = s.run()
    assert [r["t"] for r in s.results] == [3.0, 6.0, 9.0]
    assert config["queue_depth"] == 16 and med["score"] == 2.0
