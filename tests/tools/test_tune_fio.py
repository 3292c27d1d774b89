"""The fio comparison shared by ds_nvme_tune and bench/aio_bench.py: the command fio gets, the file layout
both sides use, the interleaved comparison and the warning for a ratio beyond 1.2x either way. Real fio, tiny
files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from deepnvme.tools.tune import fio as tf

needs_fio = pytest.mark.skipif(shutil.which("fio") is None,
                               reason="fio is not installed (.ci/setup installs it)")
MIB = 1 << 20


def test_shares_are_whole_blocks_or_one_short_block() -> None:
    assert tf.fio_shares(64 * MIB, 2, 8 * MIB) == (32 * MIB, 8 * MIB)
    assert tf.fio_shares(64 * MIB, 1, 1 * MIB) == (64 * MIB, 1 * MIB)
    assert tf.fio_shares(4 * MIB, 2, 8 * MIB) == (2 * MIB, 2 * MIB)  # shorter than a block: one request
    assert tf.fio_shares(10 * MIB + 12345, 2, 1 * MIB) == (5 * MIB, 1 * MIB)
    for bad in ((4096, 2, MIB), (MIB, 0, MIB), (MIB, 1, 0)):
        with pytest.raises(ValueError):
            tf.fio_shares(*bad)


def test_command_gives_every_job_its_slice_of_one_file() -> None:
    cmd = tf.fio_command("/d/f.bin", "read", "libaio", 8 * MIB, 128, 2, 64 * MIB)
    for arg in ("--filename=/d/f.bin", "--rw=read", f"--bs={8 * MIB}", "--direct=1", "--ioengine=libaio",
                "--iodepth=128", "--iodepth_batch_submit=128", "--numjobs=2", f"--size={32 * MIB}",
                f"--offset_increment={32 * MIB}", "--fallocate=none", "--scramble_buffers=0",
                "--group_reporting", "--output-format=json"):
        assert arg in cmd, arg
    assert "--fixedbufs" not in cmd
    assert "--fixedbufs" in tf.fio_command("/d/f.bin", "write", "io_uring", MIB, 32, 1, 64 * MIB)
    with pytest.raises(ValueError, match="op"):
        tf.fio_command("/d/f.bin", "randread", "libaio", MIB, 32, 1, 64 * MIB)


@pytest.mark.parametrize("ratio, warned", [(1.0, False), (1.19, False), (1.2, False), (1 / 1.2, False),
                                           (1.21, True), (0.82, True), (2.88, True), (0.37, True)])
def test_mismatch_either_way(ratio: float, warned: bool) -> None:
    assert tf.mismatch(ratio) is warned
    w = tf.mismatch_warning("read", ratio)
    assert (w is not None) is warned
    if warned:
        assert w.startswith("WARNING: read:") and "did not measure the same thing" in w
        assert f"{ratio:.2f}x" in w


def comparison(write: float, read: float, same_layout: bool = True) -> dict:
    return {"write": {"deepnvme": 3.0 * write, "fio": 3.0, "ratio": write},
            "read": {"deepnvme": 2.0 * read, "fio": 2.0, "ratio": read},
            "meta": {"bytes": 4 * MIB, "repeats": 3, "same_layout": same_layout, "fio_engine": "libaio"}}


def test_format_warns_only_for_the_suspect_op() -> None:
    lines = tf.format_comparison("/d", "cfg", comparison(1.05, 2.16))
    warnings = [line for line in lines if line.startswith("WARNING")]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: read:")
    assert lines[-1] == tf.MISMATCH_CAUSES
    assert "deepnvme/fio = 1.05x" in lines[0] and "deepnvme/fio = 2.16x" in lines[0]
    calm = tf.format_comparison("/d", "cfg", comparison(0.95, 1.1))
    assert not [line for line in calm if "WARNING" in line] and tf.MISMATCH_CAUSES not in calm
    moved = tf.format_comparison("/d", "cfg", comparison(1.0, 1.0, same_layout=False))
    assert any("size or allocation changed" in line for line in moved)


@needs_fio
@pytest.mark.parametrize("engine", ["libaio", "io_uring"])
def test_real_fio_overwrites_both_slices_in_place(engine: str, tmp_path: Path) -> None:
    """Two jobs cover the one file between them (each its half), and the layout stays as laid out."""
    path = str(tmp_path / "f.bin")
    tf.lay_out(path, 4 * MIB)
    before, laid = Path(path).read_bytes(), tf.layout_of(path)
    try:
        run = tf.run_fio_command(tf.fio_command(path, "write", engine, MIB, 2, 2, 4 * MIB), timeout=60)
    except RuntimeError as exc:
        if engine == "io_uring" and ("io_uring" in str(exc) or "fixedbufs" in str(exc)):
            pytest.skip(f"fio's io_uring is refused here: {str(exc)[-200:]}")
        raise
    after = Path(path).read_bytes()
    assert run.nbytes == 4 * MIB and run.seconds > 0 and run.cpu >= 0
    assert run.seconds >= run.fio_seconds > 0  # the jobs' common span, never less than fio's own figure
    assert tf.layout_of(path) == laid
    half = 2 * MIB
    assert after[:half] != before[:half] and after[half:] != before[half:]
    back = tf.run_fio_command(tf.fio_command(path, "read", engine, MIB, 2, 2, 4 * MIB), timeout=60)
    assert back.nbytes == 4 * MIB and Path(path).read_bytes() == after


def test_span_runs_from_the_first_issue_to_the_last_completion_over_all_jobs(tmp_path: Path) -> None:
    """Two jobs that ran one after the other: 30 ms of transfers each, 100 ms from first issue to last end,
    which is what the run took, whatever each job's own clock says."""
    ms = 1_000_000  # latencies are logged in ns
    (tmp_path / "req_lat.1.log").write_text(f"1000010, {10 * ms}, 0, 1048576, 0\n"
                                            f"1000030, {20 * ms}, 0, 1048576, 0\n")
    (tmp_path / "req_lat.2.log").write_text(f"1000090, {10 * ms}, 0, 1048576, 0\n"
                                            f"1000100, {15 * ms}, 0, 1048576, 0\n")
    (tmp_path / "req_clat.1.log").write_text(f"999000, {1 * ms}, 0, 1048576, 0\n")  # not the latency log
    assert tf._span_seconds(str(tmp_path)) == pytest.approx(0.100)
    empty = tmp_path / "none"
    empty.mkdir()
    assert tf._span_seconds(str(empty)) == 0.0


def test_run_refuses_a_file_fio_would_lay_out_itself(tmp_path: Path) -> None:
    missing = str(tmp_path / "no" / "such.bin")
    with pytest.raises(ValueError, match="such.bin: missing"):
        tf.run_fio_command(tf.fio_command(missing, "read", "libaio", MIB, 2, 1, MIB), timeout=60)
    short = str(tmp_path / "short.bin")
    tf.lay_out(short, MIB)
    with pytest.raises(ValueError, match=f"short.bin: {MIB} bytes"):
        tf.run_fio_command(tf.fio_command(short, "write", "libaio", MIB, 2, 2, 2 * MIB), timeout=60)
    assert tf.layout_of(short)[0] == MIB and not (tmp_path / "no").exists()


@needs_fio
def test_run_fio_fails_with_fios_message(tmp_path: Path) -> None:
    path = str(tmp_path / "f.bin")
    tf.lay_out(path, MIB)
    with pytest.raises(RuntimeError, match="fio .* failed"):
        tf.run_fio_command(tf.fio_command(path, "read", "no_such_engine", MIB, 2, 1, MIB), timeout=60)


@needs_fio
def test_compare_with_fio_interleaved_on_one_file(tmp_path: Path) -> None:
    from deepnvme import AsyncIOBuilder

    aio = AsyncIOBuilder().load()
    engine = "libaio" if "libaio" in aio.available_engines() else aio.available_engines()[0]
    config = {"block_size": MIB, "queue_depth": 4, "single_submit": False, "overlap_events": True,
              "intra_op_parallelism": 2, "engine": engine}
    result = tf.compare_with_fio(aio, str(tmp_path), config, 4 * MIB + 777, ["write", "read"], repeats=2)
    assert result["meta"]["bytes"] == 4 * MIB and result["meta"]["same_layout"] is True
    for op in ("write", "read"):
        r = result[op]
        assert len(r["samples"]["deepnvme"]) == 2 and len(r["samples"]["fio"]) == 2
        assert r["ratio"] == pytest.approx(r["deepnvme"] / r["fio"])
    assert not list(tmp_path.iterdir())  # the comparison's file is removed


@needs_fio
def test_tuner_prints_the_same_settings_comparison(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from deepnvme.tools import tune

    rc = tune.main(["--nvme_dir", str(tmp_path), "--io_size", "2M", "--log_dir", str(tmp_path / "logs"),
                    "--sweep_config", '{"block_size": ["1M"], "queue_depth": [4], "io_parallel": [2]}',
                    "--engine", "posix", "--time_budget", "10", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    cmp = rec["fio_comparison"]
    assert set(cmp) == {"write", "read", "warnings"}
    assert cmp["warnings"] == [op for op in ("write", "read") if tf.mismatch(cmp[op]["ratio"])]
    assert "deepnvme and fio (psync) at the same settings" in err and "interleaved runs" in err
    assert ("WARNING" in err) == bool(cmp["warnings"])
    assert not list(tmp_path.glob("_deepnvme_tune*"))


@needs_fio
def test_fixedbufs_refused_falls_back_and_says_so(tmp_path: Path) -> None:
    """Without CAP_IPC_LOCK and with a small RLIMIT_MEMLOCK fio cannot register its buffers: the run goes on
    without --fixedbufs and reports that it did."""
    import os
    import subprocess
    import sys

    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is not installed")
    drop = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv to drop CAP_IPC_LOCK")
        drop = ["setpriv", "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock"]
    path = str(tmp_path / "f.bin")
    tf.lay_out(path, 8 * MIB)
    code = ("import sys; from deepnvme.tools.tune import fio as tf\n"
            f"r = tf.run_fio_command(tf.fio_command({path!r}, 'read', 'io_uring', 1 << 20, 8, 1, 8 << 20))\n"
            "print(r.fixedbufs, r.nbytes)")
    proc = subprocess.run([*drop, "prlimit", "--memlock=65536:65536", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0 and "io_uring" in proc.stderr and "fixedbufs" not in proc.stderr:
        pytest.skip(f"fio's io_uring is refused here: {proc.stderr[-200:]}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", str(8 * MIB)]


def test_fio_environment_keeps_other_glibc_tunables(monkeypatch: pytest.MonkeyPatch) -> None:
    """fio gets malloc's huge-page tunable appended, and the caller's own tunables survive."""
    from deepnvme.tools.tune.fio import fio_environment

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert fio_environment()["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    monkeypatch.delenv("GLIBC_TUNABLES")
    assert fio_environment()["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
