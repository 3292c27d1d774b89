"""The engine catalogue (op_builder/engines.py) against the C++ it describes: one truth, checked here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from op_builder import AsyncIOBuilder, engines, probe

REPO_ROOT = Path(__file__).resolve().parents[2]
C_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "do", "defined"}


def _code(path: Path) -> str:
    """A C/C++ file without its comments."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _calls(path: Path) -> set[str]:
    """Plain function names called in a file (not members, not qualified names)."""
    return set(re.findall(r"(?<![\w:.>])([A-Za-z_]\w*)\s*\(", _code(path))) - C_KEYWORDS


def _header(name: str) -> Path | None:
    for d in ("/usr/include", "/usr/local/include"):
        if Path(d, name).is_file():
            return Path(d, name)
    return None


def test_cpp_engine_list_matches_the_catalogue():
    """csrc/aio/engine_list.h has the catalogue's rows, in its order, with the same auto-pick flag."""
    text = _code(REPO_ROOT / "csrc/aio/engine_list.h")
    rows = re.findall(r"DNV_ENGINE\((\w+),\s*\"([^\"]+)\",\s*(true|false),\s*(\w+)\)", text)
    assert [(cid, name, auto == "true") for cid, name, auto, _ in rows] == \
        [(e.cpp_id, e.name, e.automatic) for e in engines.ENGINES]


@pytest.mark.parametrize("engine", engines.ENGINES, ids=lambda e: e.name)
def test_each_engine_file_defines_its_entry_points(engine):
    """engine_<cpp_id>.cpp defines make_<cpp_id>_engine and probe_<cpp_id>; a library engine has a stub
    for builds without its library, switched by the catalogue's define."""
    code = _code(REPO_ROOT / engine.source)
    for fn in (f"make_{engine.cpp_id}_engine", f"probe_{engine.cpp_id}"):
        assert re.search(rf"\b{fn}\s*\([^;]*\)\s*\{{", code), f"{engine.source} does not define {fn}"
    if engine.needs_library:
        assert f"#if {engine.define}" in code and "#else" in code and f"<{engine.header}>" in code


@pytest.mark.parametrize("engine", [e for e in engines.ENGINES if e.needs_library], ids=lambda e: e.name)
def test_probe_functions_are_exactly_what_the_engine_calls(engine):
    """The functions the library probe links against are every library function the engine file calls
    (parsed from the source, and found declared in the library's header), and nothing else."""
    header = _header(engine.header)
    if header is None:
        pytest.skip(f"{engine.header} is not installed: cannot tell its functions apart")
    declared = set(re.findall(r"\b([A-Za-z_]\w*)\s*\(", _code(header)))
    called = _calls(REPO_ROOT / engine.source) & declared
    assert sorted(called) == sorted(engine.functions)


def test_probes_and_builder_derive_from_the_catalogue():
    """The probe lists, the builder's defines/link flags and probe inputs all come from the rows."""
    assert probe.LIBAIO_FUNCTIONS == engines.by_name("libaio").functions
    assert probe.LIBURING_FUNCTIONS == engines.by_name("io_uring").functions
    b = AsyncIOBuilder()
    found = b.engines()
    for e in (e for e in engines.ENGINES if e.needs_library):
        assert (f"-D{e.define}=1" in b.cxx_args()) == found[e.probe]
        assert (f"-l{e.library}" in b.extra_ldflags()) == found[e.probe]
    headers, libs, _ = b.probe_inputs()
    assert set(headers) == {e.header for e in engines.ENGINES if e.needs_library}
    assert set(libs) == {e.library for e in engines.ENGINES if e.needs_library}
    assert set(b.sources()) >= {e.source for e in engines.ENGINES}


def test_the_built_module_knows_the_catalogues_engines(aio_module):
    """engine_status() lists every catalogue engine, in order; available ones are the automatic subset."""
    assert list(aio_module.engine_status()) == [e.name for e in engines.ENGINES]
    assert set(aio_module.available_engines()) <= set(engines.names())
    assert aio_module.available_engines()[-1] == "posix"
