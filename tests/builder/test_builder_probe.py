"""Probes: real compile-and-link checks, positive and negative, honouring CC/CFLAGS/LDFLAGS/CONDA_PREFIX."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from op_builder import probe


@pytest.fixture(autouse=True)
def _fresh_probes():
    probe.clear_cache()
    yield
    probe.clear_cache()


def _make_lib(root: Path, name: str = "dnfake", function: str = "dnfake_answer") -> Path:
    """A header and a static library in root/include and root/lib, for the flag-honouring probes."""
    (root / "include").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "include" / f"{name}.h").write_text(f"int {function}(void);\n")
    src = root / f"{name}.c"
    src.write_text(f"int {function}(void) {{ return 42; }}\n")
    obj = root / f"{name}.o"
    subprocess.run(["cc", "-c", str(src), "-o", str(obj)], check=True)
    subprocess.run(["ar", "rcs", str(root / "lib" / f"lib{name}.a"), str(obj)], check=True)
    return root


def test_libaio_probe_matches_the_header_on_disk():
    cap = probe.libaio()
    if Path("/usr/include/libaio.h").exists():
        assert cap.ok, cap.reason
        assert "libaio" in cap.detail
    else:
        assert not cap.ok and "libaio.h" in cap.reason and "libaio-dev" in cap.fix


def test_liburing_probe_checks_every_function_it_lists():
    cap = probe.liburing()
    if Path("/usr/include/liburing.h").exists():
        assert cap.ok, cap.reason
        assert "liburing" in cap.detail
    else:
        assert not cap.ok and "liburing-dev" in cap.fix
    assert "io_uring_register_buffers" in probe.LIBURING_FUNCTIONS


def test_missing_function_is_reported_by_name():
    cap = probe.has_function(["io_setup", "deepnvme_no_such_function"], ["aio"], ["libaio.h"])
    assert not cap.ok
    assert "deepnvme_no_such_function" in cap.reason
    assert cap.fix


def test_undefined_symbol_without_header_is_a_link_failure():
    cap = probe.has_function(["deepnvme_no_such_symbol"])
    assert not cap.ok
    assert "deepnvme_no_such_symbol not found" in cap.reason
    assert "undefined reference" in cap.reason  # the compiler's own last lines are kept


def test_missing_header_is_reported():
    cap = probe.has_function(["io_setup"], ["aio"], ["deepnvme_no_such_header.h"])
    assert not cap.ok
    assert "header deepnvme_no_such_header.h not found" in cap.reason


def test_missing_library_is_reported():
    cap = probe.has_function(["io_setup"], ["deepnvme_no_such_lib"])
    assert not cap.ok
    assert "libdeepnvme_no_such_lib not found" in cap.reason


def test_results_are_cached_per_process():
    assert probe.libaio() is probe.libaio()
    first = probe.has_function(["printf"], (), ["stdio.h"])
    assert probe.has_function(("printf",), [], ("stdio.h",)) is first


def test_cflags_and_ldflags_are_honoured(tmp_path, monkeypatch):
    root = _make_lib(tmp_path / "prefix")
    assert not probe.has_function(["dnfake_answer"], ["dnfake"], ["dnfake.h"]).ok
    monkeypatch.setenv("CFLAGS", f"-I{root / 'include'}")
    monkeypatch.setenv("LDFLAGS", f"-L{root / 'lib'}")
    cap = probe.has_function(["dnfake_answer"], ["dnfake"], ["dnfake.h"])
    assert cap.ok, cap.reason


def test_conda_prefix_is_honoured(tmp_path, monkeypatch):
    root = _make_lib(tmp_path / "conda")
    monkeypatch.setenv("CONDA_PREFIX", str(root))
    assert probe.has_function(["dnfake_answer"], ["dnfake"], ["dnfake.h"]).ok


def test_cc_is_honoured(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/deepnvme-cc")
    assert not probe.compiler().ok
    cap = probe.has_function(["printf"], (), ["stdio.h"])
    assert not cap.ok and "deepnvme-cc" in cap.reason
    monkeypatch.setenv("CC", "gcc -DDEEPNVME_PROBE=1")  # CC may carry arguments
    assert probe.compiler().ok
    assert probe.has_function(["printf"], (), ["stdio.h"]).ok


def test_io_uring_runtime_gives_a_reason_when_it_fails():
    cap = probe.io_uring_runtime()
    assert cap.name == "io_uring runtime"
    if cap.ok:
        assert "read" in cap.detail
    else:
        assert cap.reason and cap.fix


def test_compiler_and_ninja():
    assert probe.compiler().ok
    assert "c++" in probe.compiler().detail
    nin = probe.ninja()
    assert nin.ok, nin.reason


def test_cufile_found_or_says_how_to_get_it():
    cap = probe.cufile()
    loc = probe.find_cufile()
    if loc.include_dir is None:
        assert not cap.ok and "cufile.h" in cap.reason and "nvidia-cufile" in cap.fix
    elif loc.library_dir is not None:  # e.g. the nvidia-cufile wheel: header and library both found
        assert cap.ok, cap.reason


def test_cuda_probe_on_a_cpu_torch():
    torch = pytest.importorskip("torch")
    cap = probe.cuda()
    if torch.version.cuda is None:
        assert not cap.ok and "CPU-only" in cap.reason and cap.fix


def test_arch_flags_survive_a_broken_py_cpuinfo(monkeypatch):
    broken = types.ModuleType("cpuinfo")

    def boom():
        raise OSError("no cpuinfo here")

    broken.get_cpu_info = boom
    monkeypatch.setitem(sys.modules, "cpuinfo", broken)
    flags = probe.native_arch_flags()
    assert isinstance(flags, list)
    if os.uname().machine in ("x86_64", "aarch64"):
        assert flags == ["-march=native"]


def test_state_fingerprint_sees_a_new_header(tmp_path, monkeypatch):
    monkeypatch.setenv("CPATH", str(tmp_path))
    before = probe.state_fingerprint(["dn_new.h"])
    assert probe.state_fingerprint(["dn_new.h"]) == before
    (tmp_path / "dn_new.h").write_text("")
    assert probe.state_fingerprint(["dn_new.h"]) != before
