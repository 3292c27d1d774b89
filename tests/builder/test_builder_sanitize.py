"""DEEPNVME_SANITIZE: which sanitizers, their flags, a build name of their own, and tests/sanitize/run.sh.

The sanitized runs themselves are CI's (.ci/sanitize): a sanitized build takes minutes, too long for here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from op_builder import AsyncIOBuilder, PinMemoryBuilder, sanitize

RUNNER = Path(__file__).resolve().parents[1] / "sanitize" / "run.sh"


@pytest.mark.parametrize(("text", "names", "suffix"), [
    ("", (), ""),
    ("address,undefined", ("address", "undefined"), "_asan_ubsan"),
    (" undefined , address ", ("address", "undefined"), "_asan_ubsan"),
    ("thread", ("thread",), "_tsan"),
    ("undefined", ("undefined",), "_ubsan"),
])
def test_selected_and_suffix(monkeypatch: pytest.MonkeyPatch, text: str, names: tuple[str, ...],
                             suffix: str) -> None:
    monkeypatch.setenv(sanitize.ENV, text)
    assert sanitize.selected() == names
    assert sanitize.module_suffix() == suffix


@pytest.mark.parametrize("text", ["memory", "address,thread", "adress"])
def test_bad_values_name_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(sanitize.ENV, text)
    with pytest.raises(ValueError, match=sanitize.ENV):
        sanitize.selected()


@pytest.mark.parametrize("builder_cls", [AsyncIOBuilder, PinMemoryBuilder])
def test_sanitized_build_has_its_own_name_flags_and_key(monkeypatch: pytest.MonkeyPatch, builder_cls) -> None:
    """A sanitized build never shares a module name, folder or key with the normal one."""
    pytest.importorskip("torch")
    monkeypatch.delenv(sanitize.ENV, raising=False)
    plain = builder_cls()
    plain_dir, plain_key, plain_name = plain.jit_build_dir(), plain.jit_key(), plain.jit_module_name()
    assert not any("sanitize" in a for a in [*plain.cxx_args(), *plain.extra_ldflags()])
    for text, tag in (("address,undefined", "_asan_ubsan"), ("thread", "_tsan")):
        monkeypatch.setenv(sanitize.ENV, text)
        b = builder_cls()
        b.jit_mode = True  # the flags are a JIT build's (see test_a_prebuild_is_never_sanitized)
        assert b.jit_module_name() == plain_name + tag
        # the same source tree's folder, under the sanitized module's name
        assert b.jit_build_dir() == plain_dir.with_name(plain_dir.name.replace(plain_name, plain_name + tag))
        assert b.jit_key() != plain_key
        assert f"-fsanitize={text}" in b.cxx_args() and f"-fsanitize={text}" in b.extra_ldflags()
        assert b.cxx_args().index("-O1") > b.cxx_args().index("-O3")  # the later -O wins
    monkeypatch.setenv(sanitize.ENV, "address,undefined")
    b = builder_cls()
    b.jit_mode = True
    assert "-fno-sanitize-recover=undefined" in b.cxx_args()


@pytest.mark.parametrize("builder_cls", [AsyncIOBuilder, PinMemoryBuilder])
def test_a_prebuild_is_never_sanitized(monkeypatch: pytest.MonkeyPatch, builder_cls) -> None:
    """Outside a JIT build the flags carry no sanitizer, and builder() (setup.py's prebuild) refuses while
    DEEPNVME_SANITIZE is set: the installed module has the op's normal name, so every later run would load
    a sanitized op without asking for one."""
    monkeypatch.setenv(sanitize.ENV, "address,undefined")
    b = builder_cls()
    assert not any("sanitize" in a for a in [*b.cxx_args(), *b.extra_ldflags()])
    with pytest.raises(ValueError, match=sanitize.ENV):
        b.builder()
    assert not any("sanitize" in a for a in [*b.cxx_args(), *b.extra_ldflags()])


def test_setup_refuses_a_sanitized_prebuild(tmp_path: Path) -> None:
    """``DS_BUILD_AIO=1`` with DEEPNVME_SANITIZE set stops setup.py before anything is compiled, naming the
    variable (``--version`` is enough: the ops to prebuild are chosen when setup.py starts)."""
    pytest.importorskip("torch")
    root = RUNNER.parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_BUILD_")}
    env.update(DS_BUILD_AIO="1", DEEPNVME_SANITIZE="address,undefined")
    res = subprocess.run([sys.executable, str(root / "setup.py"), "--version"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "DEEPNVME_SANITIZE='address,undefined' applies to JIT builds only" in res.stderr


def _runner_env(*args: str) -> dict[str, str]:
    out = subprocess.run([str(RUNNER), *args, "env", "-0"], capture_output=True, timeout=60, check=True)
    return dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)


@pytest.mark.parametrize(("sanitizers", "runtime", "options"), [
    ("address,undefined", "libasan.so", "ASAN_OPTIONS"),
    ("thread", "libtsan.so", "TSAN_OPTIONS"),
    ("undefined", "libubsan.so", "UBSAN_OPTIONS"),
])
def test_runner_preloads_the_compilers_runtime(sanitizers: str, runtime: str, options: str) -> None:
    cxx = os.environ.get("CXX", "").strip() or "c++"
    path = subprocess.run([cxx, f"-print-file-name={runtime}"], capture_output=True, text=True,
                          timeout=60).stdout.strip()
    if path == runtime or not os.path.exists(path):
        pytest.skip(f"{cxx} has no {runtime}")
    env = _runner_env(sanitizers)
    assert env["DEEPNVME_SANITIZE"] == sanitizers
    assert env["LD_PRELOAD"].startswith(env[sanitize.PRELOADED_ENV])
    assert env["LD_PRELOAD"].split()[0] == os.path.realpath(path)
    assert "halt_on_error=1" in env[options]
    if options == "ASAN_OPTIONS":
        assert "detect_leaks=0" in env[options] and "halt_on_error=1" in env["UBSAN_OPTIONS"]
    if options == "TSAN_OPTIONS":
        supp = env[options].split("suppressions=")[1].split()[0]
        assert Path(supp).is_file()


def test_runner_usage() -> None:
    res = subprocess.run([str(RUNNER), "address"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "usage" in res.stderr


def test_compilers_run_without_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """What run.sh preloaded for Python is left out while the builder's compilers run, and put back after."""
    monkeypatch.setenv("LD_PRELOAD", "/rt/libasan.so /rt/libstdc++.so /other/libfoo.so")
    monkeypatch.setenv(sanitize.PRELOADED_ENV, "/rt/libasan.so /rt/libstdc++.so")
    with sanitize.compiler_environment():
        assert os.environ["LD_PRELOAD"] == "/other/libfoo.so"
    assert os.environ["LD_PRELOAD"] == "/rt/libasan.so /rt/libstdc++.so /other/libfoo.so"
    monkeypatch.setenv("LD_PRELOAD", "/rt/libasan.so /rt/libstdc++.so")
    with sanitize.compiler_environment():
        assert "LD_PRELOAD" not in os.environ
    assert os.environ["LD_PRELOAD"] == "/rt/libasan.so /rt/libstdc++.so"
