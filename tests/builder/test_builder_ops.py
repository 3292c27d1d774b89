"""Builders, registry and load() decisions that need no compilation."""

from __future__ import annotations

import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
from builder_helpers import REPO_ROOT, run_python, write_entry_point, write_plugin

import op_builder
from op_builder import AsyncIOBuilder, GDSBuilder, OpBuilder, PinMemoryBuilder, registry
from op_builder.builder import csrc_root
from op_builder.probe import Capability

MISSING = Capability("x", False, "", "not here", "install it")


def test_import_runs_nothing_and_needs_no_torch():
    out = run_python("""
        import sys
        import op_builder, deepnvme
        ops = op_builder.ALL_OPS
        names = list(ops)
        abs_names = [b.absolute_name() for b in ops.values()]
        result = {"torch": "torch" in sys.modules, "names": names, "abs": abs_names,
                  "same": deepnvme.AsyncIOBuilder is op_builder.AsyncIOBuilder}
    """)
    assert out["calls"] == []  # no probe, no compiler
    assert out["result"]["torch"] is False
    assert out["result"]["names"][:3] == ["async_io", "gds", "pin_memory"]
    assert out["result"]["abs"][:3] == ["deepnvme.ops.async_io_op", "deepnvme.ops.gds_op",
                                        "deepnvme.ops.pin_memory_op"]
    assert out["result"]["same"] is True


def test_exports():
    for name in ("OpBuilder", "CUDAOpBuilder", "TorchCPUOpBuilder", "AsyncIOBuilder", "GDSBuilder",
                 "PinMemoryBuilder", "ALL_OPS", "register"):
        assert hasattr(op_builder, name), name
    assert op_builder.ALL_OPS is op_builder.ALL_OPS


def test_async_io_contract():
    b = AsyncIOBuilder()
    assert (b.NAME, b.BUILD_VAR) == ("async_io", "DS_BUILD_AIO")
    assert b.absolute_name() == "deepnvme.ops.async_io_op"
    assert b.include_paths() == ["csrc/aio"]
    args = b.cxx_args()
    assert "-O3" in args and "-O0" not in args and "-fvisibility=hidden" in args
    assert not any(a.startswith("-march") for a in args)  # prebuilt wheels stay portable
    b.jit_mode = True
    assert set(b.arch_flags()) <= set(b.cxx_args())  # JIT builds tune for this CPU
    on_disk = sorted(f"csrc/aio/{p.name}" for p in (csrc_root() / "aio").glob("*.cpp"))
    assert b.sources() == on_disk


def test_async_io_drops_engines_it_cannot_link():
    """Without a library, its engine switch and -l flag go; the engine file then compiles as a stub that
    says why (checked by compiling both engine files with no switch at all)."""
    b = AsyncIOBuilder()
    b._probe_memo.update(libaio=MISSING, liburing=MISSING)
    assert not any(a.startswith("-DDEEPNVME_WITH") for a in b.cxx_args())
    defines = [a for a in b.cxx_args() if a.startswith("-D")]
    for name in ("engine_libaio.cpp", "engine_uring.cpp"):
        src = csrc_root() / "aio" / name
        done = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", *defines,
                               str(src)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "not_built_reason" in src.read_text()
    assert "-laio" not in b.extra_ldflags() and "-luring" not in b.extra_ldflags()
    ok = Capability("libaio", True)
    b2 = AsyncIOBuilder()
    b2._probe_memo.update(libaio=ok, liburing=MISSING)
    assert "-DDEEPNVME_WITH_LIBAIO=1" in b2.cxx_args() and b2.extra_ldflags() == ["-laio"]


def test_async_io_is_compatible_without_the_libraries():
    b = AsyncIOBuilder()
    b._probe_memo.update(libaio=MISSING, liburing=MISSING)
    if (csrc_root() / "aio" / "py_aio.cpp").exists():
        assert b.is_compatible(), b.error_log


def test_pin_memory_contract():
    b = PinMemoryBuilder()
    assert (b.NAME, b.BUILD_VAR) == ("pin_memory", "DS_BUILD_PIN_MEMORY")
    assert b.sources()[:2] == ["csrc/pin/py_pin.cpp", "csrc/aio/pinned.cpp"]
    assert all(b.src_path(s).is_file() for s in b.sources())
    assert b.include_paths() == ["csrc/aio"]


def test_gds_is_incompatible_here_with_reason_and_fix():
    torch = pytest.importorskip("torch")
    b = GDSBuilder()
    assert (b.NAME, b.BUILD_VAR) == ("gds", "DS_BUILD_GDS")
    if torch.version.cuda is None:
        assert not b.is_compatible()
        assert "cuda" in b.error_log and "fix:" in b.error_log
        with pytest.raises(RuntimeError, match="gds.*cannot be built"):
            b.jit_load()
    srcs = b.sources()
    assert "csrc/aio/py_aio.cpp" not in srcs
    assert all(s.startswith(("csrc/gds/", "csrc/aio/")) for s in srcs)
    assert {"csrc/aio", "csrc/gds"} <= set(b.include_paths())
    flags = b.extra_ldflags()
    assert "-lcudart" in flags and any("cufile" in f for f in flags)


def test_gds_syntax_check_command_needs_no_cuda_torch():
    pytest.importorskip("torch")
    argv = GDSBuilder().syntax_check_command(extra_include_dirs=["/opt/stub"])
    assert "-fsyntax-only" in argv and "-I/opt/stub" in argv
    assert any(a.startswith("-isystem") and a.endswith("/torch/include") for a in argv)
    if Path("/usr/local/cuda/include").is_dir():
        assert "-isystem/usr/local/cuda/include" in argv


def test_sources_found_in_the_tree():
    assert csrc_root() == REPO_ROOT / "csrc"
    assert AsyncIOBuilder().src_path("csrc/aio/x.cpp") == REPO_ROOT / "csrc" / "aio" / "x.cpp"


def test_register_adds_to_all_ops_and_rejects_a_name_clash(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    write_plugin(tmp_path, pkg="regplug", name="reg_op")
    import regplug

    ops = op_builder.ALL_OPS
    monkeypatch.setattr(registry, "_registered", list(registry._registered))
    try:
        assert op_builder.register(regplug.TinyBuilder) is regplug.TinyBuilder
        assert isinstance(ops["reg_op"], regplug.TinyBuilder)
        assert list(ops)[:3] == ["async_io", "gds", "pin_memory"]
        op_builder.register(regplug.TinyBuilder)  # same class again: harmless

        class Impostor(regplug.TinyBuilder):
            pass

        with pytest.raises(ValueError, match="already taken"):
            op_builder.register(Impostor)
        with pytest.raises(TypeError):
            op_builder.register(object)
    finally:
        ops.pop("reg_op", None)


def test_a_broken_plugin_is_skipped_with_a_warning(tmp_path):
    group = registry.ENTRY_POINT_GROUP
    write_entry_point(tmp_path, "brokenplug", group, "broken", "no_such_module_x:Builder")
    write_plugin(tmp_path, pkg="goodplug", name="good_op")
    write_entry_point(tmp_path, "goodplug", registry.ENTRY_POINT_GROUP, "good", "goodplug:TinyBuilder")
    out = run_python("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import op_builder
            names = list(op_builder.ALL_OPS)
        result = {"names": names, "warnings": [str(w.message) for w in caught]}
    """, paths=[tmp_path])
    assert out["result"]["names"][:3] == ["async_io", "gds", "pin_memory"]
    assert "good_op" in out["result"]["names"]
    assert any("no_such_module_x" in w for w in out["result"]["warnings"])


class _FakeOp(OpBuilder):
    NAME = "fake_prebuilt"

    def sources(self) -> list[str]:
        return []

    def absolute_name(self) -> str:
        return "dn_fake_prebuilt_mod"


def _record(monkeypatch, version: str | None, cuda: str | None) -> None:
    rec = types.ModuleType("deepnvme._installed_ops")
    rec.installed_ops = {"fake_prebuilt": True}
    rec.torch_info = {"version": version, "cuda_version": cuda}
    monkeypatch.setitem(sys.modules, "deepnvme._installed_ops", rec)


def test_prebuilt_with_matching_torch_is_used(monkeypatch):
    torch = pytest.importorskip("torch")
    mod = types.ModuleType("dn_fake_prebuilt_mod")
    monkeypatch.setitem(sys.modules, "dn_fake_prebuilt_mod", mod)
    _record(monkeypatch, torch.__version__, torch.version.cuda)
    assert _FakeOp()._load_prebuilt() is mod


def test_prebuilt_with_other_torch_warns_and_falls_back(monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "dn_fake_prebuilt_mod", types.ModuleType("dn_fake_prebuilt_mod"))
    _record(monkeypatch, "0.0.1", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _FakeOp()._load_prebuilt() is None
    assert any("built for torch 0.0.1" in str(w.message) for w in caught)


def test_deepspeed_is_refused_our_pin_memory_builder_and_falls_back_to_its_own(tmp_path):
    """DeepSpeed's CPU builders try the top-level ``op_builder.pin_memory`` before their own; with deepnvme
    installed that is ours, and DeepSpeed's async_io library then fails to load for want of its own
    pin_memory's symbols. Code inside ``deepspeed`` is refused the name, even once our module is imported;
    everyone else gets the builder."""
    ops = tmp_path / "deepspeed" / "ops"
    ops.mkdir(parents=True)
    (tmp_path / "deepspeed" / "__init__.py").write_text("")
    (ops / "__init__.py").write_text("")
    (ops / "cpu_pin.py").write_text("try:\n    from op_builder.pin_memory import PinMemoryBuilder\n"
                                    "except ImportError:\n    PinMemoryBuilder = 'its own builder'\n")
    out = run_python("""
        from op_builder.pin_memory import PinMemoryBuilder
        import op_builder.pin_memory as module
        import deepspeed.ops.cpu_pin as ds
        result = {"deepspeed": ds.PinMemoryBuilder, "ours": PinMemoryBuilder().NAME,
                  "class": PinMemoryBuilder.__name__, "getattr": getattr(module, "PinMemoryBuilder").NAME,
                  "package": __import__("op_builder").PinMemoryBuilder is PinMemoryBuilder}
    """, paths=[tmp_path])
    assert out["result"] == {"deepspeed": "its own builder", "ours": "pin_memory",
                             "class": "PinMemoryBuilder", "getattr": "pin_memory", "package": True}
