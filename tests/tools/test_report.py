"""ds_report: DeepSpeed's layout, --json agreeing with the probes, exit status, colour, O_DIRECT, plugins."""

from __future__ import annotations

import errno
import json
import os
import pty
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deepnvme import filesystem
from deepnvme.tools.report import checks, collect, model, render

ROOT = Path(__file__).resolve().parents[2]
SEP = "-" * 50
ANSI = "\x1b["
ENV_WIDTH = 33


def _env(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ("NO_COLOR",)) -> dict[str, str]:
    """The test process's environment with the checkout first on sys.path, so this tree is what runs."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


def run_report(
    *args: str, extra_env: dict[str, str] | None = None, argv0: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ds_report in a fresh process (probes are cached per process, so each run sees the machine anew)."""
    cmd = (argv0 or [sys.executable, "-m", "deepnvme.tools.report"]) + list(args)
    return subprocess.run(
        cmd, capture_output=True, text=True, env=_env(extra_env), cwd=ROOT, timeout=300, check=False
    )


def run_on_pty(*args: str, extra_env: dict[str, str] | None = None) -> str:
    """Run ds_report with a terminal as stdout and return what it printed there."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepnvme.tools.report", *args],
        stdout=slave,
        stderr=subprocess.PIPE,
        env=_env(extra_env),
        cwd=ROOT,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError as exc:  # EIO: the child closed its end of the terminal
            if exc.errno != errno.EIO:
                raise
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    proc.wait(timeout=300)
    return b"".join(chunks).decode()


def env_line(label: str, value: str) -> str:
    """One environment line exactly as DeepSpeed lays it out."""
    return f"{label} {'.' * (ENV_WIDTH - len(label))} {value}"


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """One plain ds_report run, O_DIRECT tested on pytest's temporary directory."""
    return run_report("--dir", str(tmp_path_factory.mktemp("report")))


@pytest.fixture(scope="module")
def json_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """One ds_report --json run and its parsed document."""
    proc = run_report("--json", "--dir", str(tmp_path_factory.mktemp("report")))
    return proc, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def all_ops() -> dict[str, Any]:
    """The op registry as this process sees it."""
    import op_builder

    return dict(op_builder.ALL_OPS)


# ----------------------------------------------------------------------------------------------------
# The package face


def test_import_deepnvme_runs_nothing_and_imports_no_torch() -> None:
    """Importing deepnvme and touching its builders spawns no process (probe, compiler) and loads no torch."""
    code = textwrap.dedent("""
        import os, subprocess, sys
        def refuse(*a, **k):
            raise AssertionError("a process was started")
        subprocess.Popen.__init__ = refuse
        os.fork = os.posix_spawn = os.posix_spawnp = refuse
        import deepnvme
        assert "torch" not in sys.modules, "import deepnvme imported torch"
        deepnvme.AsyncIOBuilder, deepnvme.GDSBuilder, deepnvme.PinMemoryBuilder, deepnvme.OpBuilder
        deepnvme.register
        assert "torch" not in sys.modules, "the builder classes imported torch"
        assert "async_io" in deepnvme.ALL_OPS
        print(deepnvme.__version__)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    from deepnvme._version import __version__

    assert proc.stdout.strip() == __version__


def test_reexports_are_op_builders_own() -> None:
    """`from deepnvme import X` and `from op_builder import X` give the same objects."""
    import deepnvme
    import op_builder

    for name in ("AsyncIOBuilder", "GDSBuilder", "PinMemoryBuilder", "OpBuilder", "register"):
        assert getattr(deepnvme, name) is getattr(op_builder, name)
    assert list(deepnvme.ALL_OPS) == list(op_builder.ALL_OPS)
    assert {"AsyncIOBuilder", "ALL_OPS", "__version__"} <= set(dir(deepnvme))
    with pytest.raises(AttributeError):
        deepnvme.NoSuchBuilder  # noqa: B018 - the attribute access is the test


# ----------------------------------------------------------------------------------------------------
# Text layout


def test_text_layout_matches_deepspeed(
    text_run: subprocess.CompletedProcess[str], all_ops: dict[str, Any]
) -> None:
    """Separators, title, ninja line, header and one row per op with DeepSpeed's exact dot padding, below the
    line that says whose report it is (tests/tools/test_command.py)."""
    first, *lines = text_run.stdout.splitlines()
    assert first.startswith("ds_report (deepnvme ")
    assert lines[0] == SEP and lines[2] == SEP
    assert "extension op report" in lines[1]
    assert "JIT compiled ops requires ninja" in lines
    assert any(re.fullmatch(r"ninja \.{18} \[(OKAY|FAIL)\]", ln) for ln in lines)
    header = lines.index("op name ................ installed .. compatible")
    assert lines[header - 1] == SEP and lines[header + 1] == SEP
    # Per-op warnings (reasons) sit under their row; the table proper is the rows between the separators.
    table = lines[header + 2 : lines.index(SEP, header + 2)]
    rows = [ln for ln in table if not ln.startswith(" [WARNING] ")]
    assert len(rows) == len(all_ops), rows
    for name, row in zip(all_ops, rows):
        dots = "." * max(1, 23 - len(name))
        assert re.fullmatch(
            rf"{re.escape(name)} {dots} (\[YES\] \.{{6}}|\[NO\] \.{{7}}) \[(OKAY|NO)\]", row
        ), row
    assert [r.split()[0] for r in rows][:3] == ["async_io", "gds", "pin_memory"]


def test_text_environment_block(text_run: subprocess.CompletedProcess[str]) -> None:
    """The general environment lines carry DeepSpeed's labels, 33-column dot leaders and real values."""
    import importlib.metadata

    import deepnvme

    out = text_run.stdout
    assert "deepnvme general environment info:" in out
    assert env_line("torch version", importlib.metadata.version("torch")) in out
    assert env_line("deepnvme install path", repr([str(Path(deepnvme.__file__).parent)])) in out
    assert re.search(
        rf"^deepnvme info \.{{20}} {re.escape(deepnvme.__version__)}, \S+, \S+$", out, re.MULTILINE
    )
    assert re.search(r"^deepnvme wheel compiled w\. \.{7} \S", out, re.MULTILINE)
    assert re.search(
        r"^shared memory \(/dev/shm\) size \.{4} (\d+\.\d\d [KMGT]?B|UNKNOWN)$", out, re.MULTILINE
    )
    assert re.search(r"^torch install path \.{15} \['/", out, re.MULTILINE)


def test_text_capability_lines(text_run: subprocess.CompletedProcess[str]) -> None:
    """Every capability has its line; each one that falls short says why and what to do."""
    lines = text_run.stdout.splitlines()
    out = lines[next(i for i, ln in enumerate(lines) if ln.startswith("deepnvme I/O capabilities")) :]
    for label in (
        "compiler",
        "ninja",
        "libaio",
        "liburing",
        "io_uring runtime",
        "O_DIRECT",
        "locked memory (RLIMIT_MEMLOCK)",
        "CUDA",
        "cuFile (GDS)",
        "async_io engines",
    ):
        matches = [
            i
            for i, ln in enumerate(out)
            if re.match(rf"{re.escape(label)} \.+ \[(OKAY|NO|WARNING|FAIL)\]", ln)
        ]
        assert len(matches) == 1, (label, matches)
        i = matches[0]
        if "[NO]" in out[i] or "[FAIL]" in out[i]:
            assert out[i + 1].startswith("    reason: ") and len(out[i + 1]) > len("    reason: "), out[
                i : i + 3
            ]
            assert out[i + 2].startswith("    fix:    ") and len(out[i + 2]) > len("    fix:    "), out[
                i : i + 3
            ]


# ----------------------------------------------------------------------------------------------------
# JSON


def test_json_schema(
    json_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]], all_ops: dict[str, Any]
) -> None:
    """--json holds the op table, environment and capabilities, with the documented keys and types."""
    proc, doc = json_run
    assert proc.stdout.lstrip().startswith("{")
    assert {
        "tool",
        "deepnvme_version",
        "dir",
        "ninja",
        "ops",
        "environment",
        "capabilities",
        "async_io_usable",
        "async_io_engines",
    } <= set(doc)
    assert [op["name"] for op in doc["ops"]] == list(all_ops)
    for op in doc["ops"]:
        assert isinstance(op["installed"], bool) and isinstance(op["compatible"], bool)
        assert isinstance(op["reason"], str)
        if not op["compatible"]:
            assert op["reason"], op
    for cap in doc["capabilities"]:
        assert set(cap) == {"key", "label", "ok", "detail", "reason", "fix"}
        if not cap["ok"]:
            assert cap["reason"] and cap["fix"], cap
    env = doc["environment"]
    for key in (
        "torch_install_path",
        "torch_version",
        "deepnvme_install_path",
        "deepnvme_info",
        "deepnvme_wheel_compiled_w",
        "shm_size",
    ):
        assert key in env


def test_json_agrees_with_probes_and_builders(
    json_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]], all_ops: dict[str, Any]
) -> None:
    """What --json says about each capability and op is what the probes and builders say in this process."""
    from op_builder import probe

    _, doc = json_run
    caps = {c["key"]: c for c in doc["capabilities"]}
    for key in ("compiler", "ninja", "libaio", "liburing", "io_uring_runtime", "cuda", "cufile"):
        cap = getattr(probe, key)()
        got = caps[key]
        assert (got["ok"], got["detail"], got["reason"], got["fix"]) == (
            cap.ok,
            cap.detail,
            cap.reason,
            cap.fix,
        )
    assert doc["ninja"] == probe.ninja().ok
    from deepnvme.moe.grouped import describe

    assert caps["moe_experts"]["ok"] and caps["moe_experts"]["detail"] == describe()  # how experts multiply
    for op in doc["ops"]:
        assert op["compatible"] == bool(all_ops[op["name"]].is_compatible(verbose=False)), op
    aio = next(op for op in doc["ops"] if op["name"] == "async_io")
    assert doc["async_io_usable"] == (aio["installed"] or aio["compatible"])
    if doc["async_io_usable"]:
        assert doc["async_io_engines"][-1] == "posix"
        assert ("libaio" in doc["async_io_engines"]) == caps["libaio"]["ok"]


def test_text_and_json_agree(
    text_run: subprocess.CompletedProcess[str],
    json_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    """The two renderings come from the same facts: same op markers, same capability verdicts."""
    _, doc = json_run
    for op in doc["ops"]:
        installed = r"\[YES\]" if op["installed"] else r"\[NO\]"
        compatible = r"\[OKAY\]" if op["compatible"] else r"\[NO\]"
        assert re.search(
            rf"^{re.escape(op['name'])} \.+ {installed} \.+ {compatible}$", text_run.stdout, re.MULTILINE
        )
    for cap in doc["capabilities"]:
        if cap["key"] == "o_direct":
            continue  # tested in a different directory by each run
        marker = "(OKAY|WARNING)" if cap["ok"] else "(NO|FAIL)"
        assert re.search(rf"^{re.escape(cap['label'])} \.+ \[{marker}\]", text_run.stdout, re.MULTILINE), cap


# ----------------------------------------------------------------------------------------------------
# Exit status, flags, entry points


def test_exit_status_follows_async_io(
    text_run: subprocess.CompletedProcess[str],
    json_run: tuple[subprocess.CompletedProcess[str], dict[str, Any]],
) -> None:
    """0 when async_io is usable (prebuilt or JIT compatible), 1 otherwise, for text and JSON alike."""
    proc, doc = json_run
    expected = 0 if doc["async_io_usable"] else 1
    assert proc.returncode == expected, proc.stderr
    assert text_run.returncode == expected, text_run.stderr


def test_hide_flags(tmp_path: Path) -> None:
    """--hide_operator_status drops the op table, --hide_errors_and_warnings the warnings; same exit."""
    full = run_report("--dir", str(tmp_path))
    hidden = run_report("--dir", str(tmp_path), "--hide_operator_status", "--hide_errors_and_warnings")
    assert "op name ................ installed .. compatible" not in hidden.stdout
    assert "JIT compiled ops requires ninja" not in hidden.stdout
    assert "deepnvme general environment info:" in hidden.stdout
    assert not re.search(r"^ \[WARNING\] ", hidden.stdout, re.MULTILINE)
    assert hidden.returncode == full.returncode
    doc = json.loads(run_report("--json", "--hide_operator_status", "--dir", str(tmp_path)).stdout)
    assert "ops" not in doc and "capabilities" in doc


def test_bin_launcher_and_module_agree(tmp_path: Path) -> None:
    """bin/ds_report is a thin launcher for the same report."""
    proc = run_report(
        "--json",
        "--hide_operator_status",
        "--dir",
        str(tmp_path),
        argv0=[sys.executable, str(ROOT / "bin" / "ds_report")],
    )
    assert proc.returncode in (0, 1), proc.stderr
    assert json.loads(proc.stdout)["deepnvme_version"]


def test_report_compiles_no_op(tmp_path: Path) -> None:
    """ds_report only probes: the torch extensions cache stays empty."""
    cache = tmp_path / "ext"
    cache.mkdir()
    proc = run_report("--json", "--dir", str(tmp_path), extra_env={"TORCH_EXTENSIONS_DIR": str(cache)})
    assert proc.returncode in (0, 1), proc.stderr
    assert list(cache.iterdir()) == []


def test_missing_compiler_makes_async_io_unusable(tmp_path: Path) -> None:
    """With CC pointing nowhere the compiler line fails with its fix, async_io is incompatible, exit is 1."""
    proc = run_report("--json", "--dir", str(tmp_path), extra_env={"CC": str(tmp_path / "no-such-cc")})
    doc = json.loads(proc.stdout)
    compiler = next(c for c in doc["capabilities"] if c["key"] == "compiler")
    assert not compiler["ok"] and "no-such-cc" in compiler["reason"] and compiler["fix"]
    aio = next(op for op in doc["ops"] if op["name"] == "async_io")
    assert aio["compatible"] is False and "compiler" in aio["reason"]
    if aio["installed"]:
        pytest.skip("async_io is prebuilt here, so it stays usable without a compiler")
    assert doc["async_io_usable"] is False and doc["async_io_engines"] == []
    assert proc.returncode == 1
    engines = next(c for c in doc["capabilities"] if c["key"] == "async_io_engines")
    assert not engines["ok"] and engines["reason"] and engines["fix"]


# ----------------------------------------------------------------------------------------------------
# Plugins: an op registered through the entry-point group shows up in the table with its own verdict

PLUGIN = """
from op_builder import OpBuilder, probe


class NeedsUnobtainium(OpBuilder):
    \"\"\"Needs a function no library provides: its real link probe fails.\"\"\"

    NAME = "unobtainium"
    BUILD_VAR = "DS_BUILD_UNOBTAINIUM"

    def sources(self):
        return ["unobtainium.cpp"]

    def requirements(self):
        return [*super().requirements(),
                probe.has_function(["deepnvme_test_unobtainium_fn"], ["m"], name="libunobtainium")]


class BrokenProbe(OpBuilder):
    \"\"\"A plugin whose compatibility check itself crashes.\"\"\"

    NAME = "broken_probe"
    BUILD_VAR = "DS_BUILD_BROKEN_PROBE"

    def sources(self):
        return ["broken.cpp"]

    def is_compatible(self, verbose=False):
        raise RuntimeError("probe exploded")
"""


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a plugin module and a dist-info that registers it under deepnvme.op_builders."""
    from op_builder.registry import ENTRY_POINT_GROUP

    root = tmp_path_factory.mktemp("plugin")
    (root / "deepnvme_test_plugin.py").write_text(PLUGIN)
    (root / "unobtainium.cpp").write_text("// never built: the op is not compatible\n")
    dist = root / "deepnvme_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: deepnvme-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n"
        "unobtainium = deepnvme_test_plugin:NeedsUnobtainium\n"
        "broken_probe = deepnvme_test_plugin:BrokenProbe\n"
    )
    return root


def test_plugin_ops_get_rows(plugin_path: Path, tmp_path: Path) -> None:
    """Plugin rows follow the built-in ones; an incompatible plugin shows [NO] with its probe's reason."""
    extra = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(plugin_path)])}
    proc = run_report("--dir", str(tmp_path), extra_env=extra)
    out = proc.stdout
    assert re.search(r"^unobtainium \.{12} \[NO\] \.{7} \[NO\]$", out, re.MULTILINE), out
    assert re.search(r"^broken_probe \.{11} \[NO\] \.{7} \[NO\]$", out, re.MULTILINE), out
    assert re.search(r"^ \[WARNING\] unobtainium: .*deepnvme_test_unobtainium_fn", out, re.MULTILINE), out
    assert re.search(
        r"^ \[WARNING\] broken_probe: is_compatible raised RuntimeError: probe exploded", out, re.MULTILINE
    ), out
    rows = [ln.split()[0] for ln in out.splitlines() if re.match(r"\S+ \.+ \[(YES|NO)\] \.+ ", ln)]
    assert rows[:4] == ["async_io", "gds", "pin_memory", "moe"]
    assert set(rows[4:]) == {"unobtainium", "broken_probe"}
    # A plugin that cannot build does not change the verdict on async_io.
    doc = json.loads(run_report("--json", "--dir", str(tmp_path), extra_env=extra).stdout)
    assert proc.returncode == (0 if doc["async_io_usable"] else 1)
    plugin = next(op for op in doc["ops"] if op["name"] == "unobtainium")
    assert plugin == {
        "name": "unobtainium",
        "installed": False,
        "compatible": False,
        "reason": plugin["reason"],
    }
    assert "libunobtainium" in plugin["reason"]


# ----------------------------------------------------------------------------------------------------
# Colour


def test_no_colour_when_piped(text_run: subprocess.CompletedProcess[str]) -> None:
    """Piped output is plain text."""
    assert ANSI not in text_run.stdout


def test_colour_on_terminal_unless_no_color(tmp_path: Path) -> None:
    """A terminal gets coloured markers; NO_COLOR turns them off there too."""
    coloured = run_on_pty("--hide_operator_status", "--dir", str(tmp_path))
    assert f"{render.GREEN}[OKAY]{render.END}" in coloured
    plain = run_on_pty("--hide_operator_status", "--dir", str(tmp_path), extra_env={"NO_COLOR": "1"})
    assert ANSI not in plain and "[OKAY]" in plain


# ----------------------------------------------------------------------------------------------------
# O_DIRECT


@pytest.fixture
def ramfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A ramfs mount, which refuses O_DIRECT at open(); skipped where mounting is not allowed."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "ramfs", "ramfs", str(mnt)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here (needs root / CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False, timeout=30)


def test_o_direct_on_disk(tmp_path: Path) -> None:
    """On a disk filesystem the aligned write-and-read-back works, and the test file is gone afterwards."""
    _, fstype = filesystem.mount_of(str(tmp_path))
    if fstype not in ("ext4", "xfs", "btrfs", "f2fs"):
        pytest.skip(f"{tmp_path} is on {fstype or 'an unknown filesystem'}, not a local disk filesystem")
    found = checks.check_o_direct(str(tmp_path))
    assert found.ok, found
    assert fstype in found.detail and not found.reason
    assert list(tmp_path.iterdir()) == []


def test_o_direct_refused_on_ramfs(ramfs_dir: Path) -> None:
    """ramfs refuses O_DIRECT: reported with EINVAL, the buffered fallback and the fix; no file left."""
    found = checks.check_o_direct(str(ramfs_dir))
    assert not found.ok
    assert "ramfs" in found.detail
    assert "EINVAL" in found.reason and "buffered" in found.reason
    assert "ext4" in found.fix
    assert list(ramfs_dir.iterdir()) == []

    proc = run_report("--dir", str(ramfs_dir), "--hide_operator_status")
    assert re.search(r"^O_DIRECT \.+ \[NO\] refused on .*\(ramfs\)$", proc.stdout, re.MULTILINE), proc.stdout
    assert "falls back to buffered I/O" in proc.stdout
    doc = json.loads(run_report("--json", "--dir", str(ramfs_dir)).stdout)
    o_direct = next(c for c in doc["capabilities"] if c["key"] == "o_direct")
    assert o_direct["ok"] is False
    # O_DIRECT is a property of the directory, not of the op: async_io stays usable (buffered there).
    assert proc.returncode == (0 if doc["async_io_usable"] else 1)


def test_o_direct_on_missing_dir(tmp_path: Path) -> None:
    """A directory that does not exist is reported as untestable, not as a crash."""
    found = checks.check_o_direct(str(tmp_path / "nope"))
    assert not found.ok and "could not test" in found.detail and "--dir" in found.fix


# ----------------------------------------------------------------------------------------------------
# Locked memory and engines (pure logic, fed with chosen inputs)


def test_memlock_unlimited(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unlimited limit is fine and says so."""
    inf = checks.resource.RLIM_INFINITY
    monkeypatch.setattr(checks.resource, "getrlimit", lambda _: (inf, inf))
    found = checks.check_memlock()
    assert found.ok and found.detail == "unlimited"


def test_memlock_low_but_cap_ipc_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A low limit does not bind a process holding CAP_IPC_LOCK."""
    monkeypatch.setattr(checks.resource, "getrlimit", lambda _: (8 << 20, 8 << 20))
    monkeypatch.setattr(checks, "_has_cap_ipc_lock", lambda: True)
    found = checks.check_memlock()
    assert found.ok and "CAP_IPC_LOCK" in found.detail and "8 MiB" in found.detail


def test_memlock_low(monkeypatch: pytest.MonkeyPatch) -> None:
    """A low limit without CAP_IPC_LOCK is a shortfall with its reason and fix."""
    monkeypatch.setattr(checks.resource, "getrlimit", lambda _: (64 << 10, 8 << 20))
    monkeypatch.setattr(checks, "_has_cap_ipc_lock", lambda: False)
    found = checks.check_memlock()
    assert not found.ok
    assert "soft 64 KiB, hard 8 MiB" == found.detail
    assert "ulimit -l" in found.fix and "64 KiB" in found.reason


def test_cap_ipc_lock_read_from_proc() -> None:
    """The capability bit is read from this process's own status (root here normally holds it)."""
    caps = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("CapEff:"))
    assert checks._has_cap_ipc_lock() == bool(int(caps.split()[1], 16) & (1 << 14))


def _probes(**ok: bool) -> dict[str, model.Finding]:
    """Synthetic probe findings: every probe fine unless named False."""
    keys = ("compiler", "ninja", "libaio", "liburing", "io_uring_runtime", "cuda", "cufile")
    return {
        k: model.Finding(
            k,
            k,
            ok.get(k, True),
            "found" if ok.get(k, True) else "",
            "" if ok.get(k, True) else f"{k} is missing",
            "" if ok.get(k, True) else f"get {k}",
        )
        for k in keys
    }


def test_engines_all_present() -> None:
    """With liburing, a working io_uring and libaio, all three engines run and auto picks io_uring."""
    found, engines = collect.engines_finding(True, _probes(), "")
    assert engines == ["io_uring", "libaio", "posix"]
    assert found.ok and not found.reason and "auto picks io_uring" in found.detail


def test_engines_posix_only_still_usable() -> None:
    """Without libaio and liburing, async_io still works through posix threads, and the report says so."""
    found, engines = collect.engines_finding(True, _probes(libaio=False, liburing=False), "")
    assert engines == ["posix"]
    assert found.ok and "posix thread engine" in found.reason
    assert "get libaio" in found.fix and "get liburing" in found.fix
    assert render._marker(found, render.Painter(False)) == "[WARNING]"


def test_engines_io_uring_blocked_at_runtime() -> None:
    """liburing present but io_uring refused at run time (common in containers): libaio and posix remain."""
    found, engines = collect.engines_finding(True, _probes(io_uring_runtime=False), "")
    assert engines == ["libaio", "posix"]
    assert "io_uring_runtime is missing" in found.reason and found.fix == "get io_uring_runtime"


def test_engines_none_when_async_io_unusable() -> None:
    """When async_io can be neither loaded nor built, no engine runs and the line fails in red."""
    found, engines = collect.engines_finding(False, _probes(compiler=False), "no compiler")
    assert engines == [] and not found.ok
    assert found.reason == "no compiler" and found.fix == "get compiler"
    assert render._marker(found, render.Painter(False)) == "[FAIL]"


# ----------------------------------------------------------------------------------------------------
# Formatting helpers and project glue


def test_dots_and_sizes() -> None:
    """DeepSpeed's padding for ordinary names, at least one dot for long ones; 1024-based sizes."""
    assert render._dots("async_io", 23) == "." * 15
    assert render._dots("a_very_long_plugin_op_name", 23) == "."
    assert checks.human_bytes(64 * 1024 * 1024) == "64.00 MB"
    assert checks.human_bytes(512) == "512.00 B"
    assert checks.iec(8 << 20) == "8 MiB" and checks.iec(1000) == "1000 B"


def test_readme_quotes_the_ci_test_command() -> None:
    """README's test command is exactly the one .ci/run runs."""
    script = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^TEST_CMD=\((.+)\)$", script, re.MULTILINE)
    assert match
    command = shlex.join(shlex.split(match.group(1)))
    assert f"`{command}`" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------------------------------------------------
# Plain tensors: whether torch's allocator page-aligns them (real torch, in a fresh process per setting)


@pytest.mark.parametrize("thp", ["", "1"])
def test_plain_tensor_alignment_is_measured_and_read_from_the_environment(thp: str) -> None:
    """With torch imported the check measures a real allocation; without, it reads the variable torch reads.
    Both agree, and only the unaligned case carries a reason and the fix."""
    code = textwrap.dedent("""
        import json, sys
        from deepnvme.tools.report.checks import check_plain_tensors
        before = check_plain_tensors()  # torch not imported yet: from the environment
        import torch
        after = check_plain_tensors()   # measured
        print(json.dumps([before.detail, before.fix, after.detail, after.fix, "torch" in sys.modules]))
    """)
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if thp:
        env["THP_MEM_ALLOC_ENABLE"] = thp
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    before_detail, before_fix, after_detail, after_fix, imported = json.loads(out.stdout.splitlines()[-1])
    assert imported
    if thp:
        assert before_detail.startswith("page-aligned") and after_detail.startswith("page-aligned")
        assert before_fix == after_fix == ""
    else:
        assert "THP_MEM_ALLOC_ENABLE is not 1" in before_detail and "bytes past a page" in after_detail
        assert "THP_MEM_ALLOC_ENABLE=1" in before_fix and before_fix == after_fix
