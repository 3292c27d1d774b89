"""Tunables: one Python table (op_builder/tunables.py), the C++ list that mirrors it, and the env vars."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deepnvme import defaults
from op_builder import tunables

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_cpp_list_mirrors_the_python_table():
    """csrc/aio/tunables.h lists the same names, variables and rules as op_builder/tunables.py."""
    text = (REPO_ROOT / "csrc/aio/tunables.h").read_text().replace("\\\n", " ")
    rows = re.findall(r"DNV_TUNABLE\((\w+),\s*\"(\w+)\",\s*(\w+),\s*(\d+),\s*(\d+),\s*(\d+)\)", text)
    assert [(n, env, d, int(m), int(lo), int(hi)) for n, env, d, m, lo, hi in rows] == \
        [(t.name, t.env, t.define, t.multiple_of, t.minimum, t.maximum) for t in tunables.TUNABLES]
    pool = re.search(r"#define DNV_STAGING_POOL_MAX_BYTES (\d+)ULL", text)
    assert pool and int(pool.group(1)) == tunables.STAGING_POOL_MAX_BYTES


def test_every_tunable_has_a_getter_documented_from_its_row():
    """One getter per row, named after it; its docstring names the variable and the table's default."""
    for t in tunables.TUNABLES:
        getter = getattr(defaults, t.name)
        assert getter.__name__ == t.name and t.name in defaults.__all__
        assert f"``${t.env}``, default {defaults._size(t.default)}." in getter.__doc__


def _readme_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def test_readme_table_states_the_tables_defaults():
    """The README's tunables table lists exactly the table's variables with its defaults, and its figure for
    the pool's size is staging_buffers x staging_buffer_bytes."""
    readme = (REPO_ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(DEEPNVME_[A-Z_]+)` \| (\w+) \|", readme, re.MULTILINE)
    assert [(env, _readme_size(v)) for env, v in rows] == [(t.env, t.default) for t in tunables.TUNABLES]
    pool = tunables.by_name("staging_buffers").default * tunables.by_name("staging_buffer_bytes").default
    prose = readme.replace("\n", " ")
    stated = re.search(r"allocated and locked on the first staged transfer \((\d+) MiB by default\)", prose)
    assert stated and int(stated.group(1)) << 20 == pool


def test_getters_read_the_environment(monkeypatch):
    """Default when unset; the variable's value (with K/M/G) when set; ValueError naming it when bad."""
    for t in tunables.TUNABLES:
        monkeypatch.delenv(t.env, raising=False)
        assert defaults.get(t.name) == t.default
        assert defaults.describe()[t.name]["env"] == t.env and defaults.describe()[t.name]["doc"]
    monkeypatch.setenv("DEEPNVME_STAGING_BUFFER_BYTES", "256K")
    assert defaults.staging_buffer_bytes() == 256 << 10
    for bad in ("abc", "0", "1000", "-4096", "4096X"):
        monkeypatch.setenv("DEEPNVME_STAGING_BUFFER_BYTES", bad)
        with pytest.raises(ValueError, match="DEEPNVME_STAGING_BUFFER_BYTES"):
            defaults.staging_buffer_bytes()


def test_the_core_reads_every_variable(aio_module, tmp_path):
    """Each malformed variable fails aio_handle() with a ValueError naming it (the core reads that exact
    name); then small valid values still move an unaligned, staged tensor correctly."""
    code = f"""
import os, torch
from op_builder import AsyncIOBuilder, tunables
m = AsyncIOBuilder().load()
for t in tunables.TUNABLES:
    os.environ[t.env] = "12x"
    try:
        m.aio_handle()
    except ValueError as exc:
        assert t.env in str(exc), exc
    else:
        raise SystemExit(f"{{t.env}}=12x was accepted")
    del os.environ[t.env]
os.environ.update(DEEPNVME_STAGING_BUFFER_BYTES="8K", DEEPNVME_STAGING_BUFFERS="4",
                  DEEPNVME_WORKER_STAGING_BYTES="16K", DEEPNVME_MIN_SLICE_BYTES="4K")
h = m.aio_handle(block_size=65536, intra_op_parallelism=2)
data = torch.randint(0, 256, (300001,), dtype=torch.uint8)
src = torch.empty(300002, dtype=torch.uint8)[1:]  # unaligned: goes through the small staging pool
src.copy_(data)
path = {str(tmp_path / "t.bin")!r}
assert h.sync_pwrite(src, path) == 1
back = torch.empty(300002, dtype=torch.uint8)[1:]
assert h.sync_pread(back, path) == 1
assert torch.equal(back, data)
print("OK")
"""
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("DEEPNVME_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("text", ["4096\n", "\n", "\u0664096", "4096\u00a0", "999999999999999G", "2G",
                                  "2097152K", "+4096", "4_096", "4096 KB"])
def test_parser_takes_what_the_core_takes(monkeypatch, text):
    """ASCII digits, spaces and tabs only (as csrc/aio/tunables.cpp reads them), and an upper bound: values
    that the C++ parser refuses, or that would wrap around 64 bits there, are ValueErrors naming the
    variable."""
    monkeypatch.setenv("DEEPNVME_STAGING_BUFFER_BYTES", text)
    with pytest.raises(ValueError, match="DEEPNVME_STAGING_BUFFER_BYTES"):
        defaults.staging_buffer_bytes()


def test_bounds_and_pool_product(monkeypatch):
    """Each bound is inclusive; the pool (buffers x bytes) has a bound of its own, named by both variables."""
    monkeypatch.setenv("DEEPNVME_STAGING_BUFFER_BYTES", " 1G\t")
    monkeypatch.setenv("DEEPNVME_STAGING_BUFFERS", "64")
    assert defaults.staging_buffer_bytes() == 1 << 30 and defaults.staging_buffers() == 64
    monkeypatch.setenv("DEEPNVME_STAGING_BUFFERS", "65536")
    for getter in (defaults.staging_buffers, defaults.staging_buffer_bytes):
        with pytest.raises(ValueError, match="DEEPNVME_STAGING_BUFFERS x DEEPNVME_STAGING_BUFFER_BYTES"):
            getter()
    monkeypatch.setenv("DEEPNVME_STAGING_BUFFER_BYTES", "1M")
    assert defaults.staging_buffers() == 65536
    monkeypatch.setenv("DEEPNVME_STAGING_BUFFERS", "65537")
    with pytest.raises(ValueError, match="DEEPNVME_STAGING_BUFFERS.*at most 65536"):
        defaults.staging_buffers()


def _run_child(code: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPNVME_")}
    env.update(env_extra)
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              timeout=90)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the child hung with {env_extra}") from exc


_STAGED_WRITE = """
import errno, sys, torch
from op_builder import AsyncIOBuilder
m = AsyncIOBuilder().load()
src = torch.ones(8193, dtype=torch.uint8)[1:]  # unaligned: staged
try:
    h = m.aio_handle()
    h.sync_pwrite(src, sys.argv[1] if len(sys.argv) > 1 else {path!r})
except ValueError as exc:
    print("VALUE", exc)
except OSError as exc:
    print("OSERROR", exc.errno == errno.ENOMEM, exc)
else:
    print("ACCEPTED")
"""


@pytest.mark.parametrize(("env", "named"), [
    ({"DEEPNVME_STAGING_BUFFER_BYTES": "999999999999999G"}, "DEEPNVME_STAGING_BUFFER_BYTES"),
    ({"DEEPNVME_STAGING_BUFFER_BYTES": "16M", "DEEPNVME_STAGING_BUFFERS": "1099511627777"},
     "DEEPNVME_STAGING_BUFFERS"),
    ({"DEEPNVME_STAGING_BUFFER_BYTES": "16M", "DEEPNVME_STAGING_BUFFERS": "65536"},
     "DEEPNVME_STAGING_BUFFERS x DEEPNVME_STAGING_BUFFER_BYTES"),
    ({"DEEPNVME_WORKER_STAGING_BYTES": "18446744073709551616"}, "DEEPNVME_WORKER_STAGING_BYTES"),
])
def test_the_core_refuses_out_of_range_values(aio_module, tmp_path, env, named):
    """Sizes that wrapped around 64 bits once mapped a sliver of a pool whose free list never filled: a
    staged write then waited for a buffer forever. The core now refuses them with a ValueError naming the
    variable, at once."""
    done = _run_child(_STAGED_WRITE.format(path=str(tmp_path / "t.bin")), env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("VALUE") and named in done.stdout, done.stdout


def test_a_failed_staging_pool_is_enomem_and_retried(aio_module, tmp_path):
    """A pool that cannot be mapped (address space limited below it) fails the staged request with ENOMEM,
    promptly; once memory is there again the next staged request allocates it and succeeds."""
    code = f"""
import errno, resource, torch
from op_builder import AsyncIOBuilder
m = AsyncIOBuilder().load()
h = m.aio_handle(intra_op_parallelism=1)
src = torch.ones(8193, dtype=torch.uint8)[1:]  # unaligned: staged
path = {str(tmp_path / "t.bin")!r}
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm + (64 << 20), hard))
try:
    h.sync_pwrite(src, path)
except OSError as exc:
    assert exc.errno == errno.ENOMEM, exc
else:
    raise SystemExit("a 512 MiB pool was mapped under a 64 MiB address-space margin")
finally:
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
assert h.sync_pwrite(src, path) == 1
back = torch.zeros(8193, dtype=torch.uint8)[1:]
assert h.sync_pread(back, path) == 1 and torch.equal(back, src)
print("OK")
"""
    done = _run_child(code, {"DEEPNVME_STAGING_BUFFER_BYTES": "256M", "DEEPNVME_STAGING_BUFFERS": "2"})
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr[-3000:]


# ------------------------------------------------------------------- handle settings, the public face

def test_handle_presets_and_limits_are_read_through_defaults() -> None:
    from deepnvme._core import handles

    presets = defaults.handle_presets()
    assert presets == {"recommended": handles.RECOMMENDED, "checkpoint": handles.CHECKPOINT,
                       "swap": handles.SWAP}
    presets["checkpoint"]["block_size"] = 1
    assert handles.CHECKPOINT["block_size"] == 8 << 20  # copies: the library's own are untouched
    assert defaults.handle_limits() == {n: limit for n, (limit, _) in tunables.HANDLE_LIMITS.items()}
    assert (defaults.HANDLE_CONFIG_ENV, defaults.HANDLE_CONFIG_FILE) == ("DEEPNVME_HANDLE_CONFIG",
                                                                         "deepnvme-handle.json")
    public = (defaults.handle_presets, defaults.handle_limits, defaults.checkpoint_settings,
              defaults.set_handle_config, defaults.write_handle_config)
    assert all(f.__doc__ and f.__name__ in defaults.__all__ for f in public)


def test_tuned_settings_are_written_and_set_through_defaults(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(defaults.HANDLE_CONFIG_ENV, raising=False)
    ckpt, other = tmp_path / "ckpt", tmp_path / "other"
    ckpt.mkdir()
    other.mkdir()
    written = defaults.write_handle_config(ckpt, {"block_size": 4 << 20, "queue_depth": 64})
    assert written == str(ckpt / defaults.HANDLE_CONFIG_FILE)
    settings, source = defaults.checkpoint_settings(ckpt / "step1")
    assert source == written and settings["block_size"] == 4 << 20 and settings["queue_depth"] == 64
    assert settings["intra_op_parallelism"] == defaults.handle_presets()["checkpoint"]["intra_op_parallelism"]
    with pytest.raises(ValueError, match="queue_depth"):
        defaults.write_handle_config(other, {"queue_depth": defaults.handle_limits()["queue_depth"] + 1})
    assert list(other.iterdir()) == []  # checked before anything is written

    defaults.set_handle_config(written)
    assert os.environ[defaults.HANDLE_CONFIG_ENV] == written
    assert defaults.checkpoint_settings(other) == (settings, written)
    bad = tmp_path / "bad.json"
    bad.write_text('{"queue_depht": 8}')
    for wrong, why in ((bad, "queue_depht"), (tmp_path / "missing.json", "names no file")):
        with pytest.raises(ValueError, match=why):
            defaults.set_handle_config(wrong)
        assert os.environ[defaults.HANDLE_CONFIG_ENV] == written  # left as it was
    defaults.set_handle_config(None)
    assert defaults.HANDLE_CONFIG_ENV not in os.environ
    assert defaults.checkpoint_settings(other)[1] == "built-in"


def test_readme_sends_no_one_into_the_private_core() -> None:
    """Every knob the README tells users to read or set is public: no `deepnvme._core.` call in it."""
    text = (REPO_ROOT / "README.md").read_text()
    assert not re.findall(r"deepnvme\._core\.\w+\.\w+\(", text)
    assert "deepnvme.defaults" in text and "set_handle_config" in text
