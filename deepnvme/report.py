"""ds_report: which deepnvme ops this machine can build and run, in DeepSpeed's layout, and why not."""

from __future__ import annotations

import argparse
import ast
import errno
import importlib
import importlib.metadata
import importlib.util
import json
import mmap
import os
import re
import resource
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from deepnvme._version import __version__

GREEN = "\033[92m"
RED = "\033[91m"
YELLOW = "\033[93m"
END = "\033[0m"

# DeepSpeed's column widths, kept so a DeepSpeed user's eye (and their grep) finds everything in place.
OP_NAME_WIDTH = 23
MARKER_WIDTH = 11
ENV_NAME_WIDTH = 33
SEPARATOR = "-" * (OP_NAME_WIDTH + MARKER_WIDTH + len("op name") + len("installed"))

# One aligned block: 4 KiB suits both 512-byte and 4 KiB logical sectors, and an mmap buffer is page aligned.
O_DIRECT_BLOCK = 4096
# Below this, one large pinned tensor or the staging pool cannot be locked; 1 GiB is a modest shard.
MEMLOCK_WANTED = 1 << 30
# DeepSpeed warns below this /dev/shm size because Docker's 64 MB default starves dataloaders and NCCL.
SHM_WANTED = 512 << 20
CAP_IPC_LOCK_BIT = 14
# A probe's reason may end with the compiler's output; the text view keeps only its last lines (JSON has all).
TEXT_TAIL_LINES = 4
# Engine names as the C++ side and DEEPNVME_ENGINE spell them, in auto's order of preference; posix (a thread
# pool doing pread/pwrite) needs nothing beyond the op itself.
ENGINE_URING, ENGINE_LIBAIO, ENGINE_POSIX = "io_uring", "libaio", "posix"


@dataclass(frozen=True)
class Finding:
    """One capability line: what was found, and when it falls short, why and what to do."""

    key: str
    label: str
    ok: bool
    detail: str
    reason: str = ""
    fix: str = ""


@dataclass
class OpRow:
    """One row of the op table; reason says why an op is not compatible or why a prebuilt is not used."""

    name: str
    installed: bool
    compatible: bool
    reason: str = ""


@dataclass
class Report:
    """Everything ds_report shows, gathered once and rendered as text or JSON."""

    ninja: Finding | None
    ops: list[OpRow] | None
    environment: dict[str, Any]
    env_warnings: list[str]
    capabilities: list[Finding]
    async_io_usable: bool
    engines: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------------
# Small helpers


def _human_bytes(n: float) -> str:
    """Format a byte count the way DeepSpeed's report does: 1024 base, two decimals, B..TB."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024:
            return f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TB"


def _iec(n: int) -> str:
    """Format a limit compactly (8 MiB, 1 GiB) for capability details."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or n % 1024:
            return f"{n} {unit}"
        n //= 1024
    return f"{n} TiB"


def _capture(argv: Sequence[str], timeout: float = 5.0) -> str | None:
    """Run a short command and return its stdout, or None when it is missing, fails or hangs."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _from_probe(key: str, label: str, cap: Any) -> Finding:
    """Turn an op_builder.probe.Capability into a Finding, tolerating missing fields from older probes."""
    return Finding(
        key=key,
        label=label,
        ok=bool(getattr(cap, "ok", False)),
        detail=str(getattr(cap, "detail", "") or ""),
        reason=str(getattr(cap, "reason", "") or ""),
        fix=str(getattr(cap, "fix", "") or ""),
    )


def _run_probe(key: str, label: str, func: Callable[[], Any]) -> Finding:
    """Call one probe; a probe that raises is itself a finding, not a crash of the whole report."""
    try:
        return _from_probe(key, label, func())
    except Exception as exc:  # noqa: BLE001 - any probe failure must still leave a readable report
        return Finding(
            key,
            label,
            False,
            "probe failed",
            f"{type(exc).__name__}: {exc}",
            "report this as a deepnvme bug, with the output of ds_report --json",
        )


# ----------------------------------------------------------------------------------------------------
# Checks deepnvme does itself (pure Python, no compiler)


def _mount_of(path: str) -> tuple[str, str]:
    """Return (mount point, filesystem type) holding path, from /proc/self/mountinfo; ('', '') if unknown."""
    best = ("", "")
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best
    real = os.path.realpath(path)
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields = head.split()
        if len(fields) < 5 or not tail:
            continue
        # mountinfo escapes space, tab, newline and backslash as octal.
        mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[0]):
            best = (mnt, tail.split()[0])
    return best


def check_o_direct(directory: str) -> Finding:
    """Create a file with O_DIRECT in directory, write and read back one aligned block, and remove it."""
    key, label = "o_direct", "O_DIRECT"
    _, fstype = _mount_of(directory)
    where = f"{directory} ({fstype})" if fstype else directory
    fallback = (
        "deepnvme falls back to buffered I/O there: it works, but every byte goes through the page "
        "cache, which costs RAM and throughput"
    )
    fix = "point --dir, and the paths you read and write, at a local disk filesystem such as ext4 or xfs"
    if not hasattr(os, "O_DIRECT"):
        return Finding(key, label, False, "O_DIRECT is not defined on this platform", fallback, fix)
    path = os.path.join(directory, f".deepnvme-odirect-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            # Some filesystems (ramfs) create the file before refusing the flag; the name is ours (O_EXCL).
            _unlink_quietly(path)
            return Finding(
                key,
                label,
                False,
                f"refused on {where}",
                f"the filesystem rejects O_DIRECT (open gave EINVAL); {fallback}",
                fix,
            )
        return Finding(
            key,
            label,
            False,
            f"could not test {directory}: {exc.strerror}",
            "a test file could not be created there",
            "pass --dir with a writable directory",
        )
    try:
        out = mmap.mmap(-1, O_DIRECT_BLOCK)
        back = mmap.mmap(-1, O_DIRECT_BLOCK)
        pattern = os.urandom(64) * (O_DIRECT_BLOCK // 64)
        out.write(pattern)
        try:
            written = os.pwrite(fd, out, 0)
            read = os.preadv(fd, [back], 0)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return Finding(
                    key,
                    label,
                    False,
                    f"open accepted O_DIRECT on {where} but a "
                    f"{O_DIRECT_BLOCK}-byte aligned transfer gave EINVAL",
                    f"the device needs a larger alignment than {O_DIRECT_BLOCK} bytes; {fallback}",
                    fix,
                )
            return Finding(
                key,
                label,
                False,
                f"I/O on {where} failed: {exc.strerror}",
                "the aligned test write or read failed",
                "check the device and free space",
            )
        if written != O_DIRECT_BLOCK or read != O_DIRECT_BLOCK or back[:] != pattern:
            return Finding(
                key,
                label,
                False,
                f"short or corrupt aligned transfer on {where}",
                f"wrote {written} and read {read} of {O_DIRECT_BLOCK} bytes",
                "check the device",
            )
        return Finding(
            key, label, True, f"supported on {where}: {O_DIRECT_BLOCK}-byte aligned write and read back"
        )
    finally:
        os.close(fd)
        _unlink_quietly(path)


def _unlink_quietly(path: str) -> None:
    """Remove the O_DIRECT test file; a file already gone is fine."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _has_cap_ipc_lock() -> bool:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK (CAP_IPC_LOCK in its effective set)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK_BIT & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def check_memlock() -> Finding:
    """Report the locked-memory limit that bounds pinned tensors and the staging pool."""
    key, label = "memlock", "locked memory (RLIMIT_MEMLOCK)"
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def show(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else _iec(v)

    limits = f"soft {show(soft)}, hard {show(hard)}"
    if soft == resource.RLIM_INFINITY:
        return Finding(key, label, True, "unlimited")
    if _has_cap_ipc_lock():
        return Finding(key, label, True, f"{limits}; not enforced: this process has CAP_IPC_LOCK")
    if soft >= MEMLOCK_WANTED:
        return Finding(key, label, True, limits)
    return Finding(
        key,
        label,
        False,
        limits,
        f"pinned (page-locked) tensors and staging buffers can lock at most {show(soft)} in total; "
        "larger requests fail to lock",
        "raise it: `ulimit -l unlimited` (as root, or up to the hard limit), '* - memlock unlimited' "
        "in /etc/security/limits.conf, or `docker run --ulimit memlock=-1`",
    )


def _shm_size() -> tuple[str, int | None]:
    """Size of /dev/shm, human readable and in bytes; ('UNKNOWN', None) when it cannot be read."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return "UNKNOWN", None
    size = st.f_frsize * st.f_blocks
    return _human_bytes(size), size


# ----------------------------------------------------------------------------------------------------
# Environment (no `import torch`: reading torch's metadata is ~100x faster and enough for the report)


def _torch_info() -> dict[str, Any]:
    """Torch's install path, version and CUDA version, without importing torch unless it already is."""
    mod = sys.modules.get("torch")
    if mod is not None and hasattr(mod, "version"):
        return {"path": list(mod.__path__), "version": mod.__version__, "cuda": mod.version.cuda}
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {"path": None, "version": None, "cuda": None}
    paths = list(spec.submodule_search_locations)
    info: dict[str, Any] = {"path": paths, "version": None, "cuda": None}
    # torch/version.py is generated as plain constant assignments; read them without executing anything.
    try:
        tree = ast.parse(Path(paths[0], "version.py").read_text())
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            value = getattr(node, "value", None)
            if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
                if target.id == "__version__":
                    info["version"] = value.value
                elif target.id == "cuda":
                    info["cuda"] = value.value
    except (OSError, SyntaxError):
        pass
    if info["version"] is None:
        try:
            info["version"] = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def _nvcc_path() -> str | None:
    """Locate nvcc as torch's cpp_extension does: CUDA_HOME/CUDA_PATH, then PATH, then /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def _nvcc_version(nvcc: str) -> str | None:
    """Return 'major.minor' from `nvcc -V`, or None when it cannot be run or parsed."""
    out = _capture([nvcc, "-V"])
    match = re.search(r"release (\d+\.\d+)", out or "")
    return match.group(1) if match else None


def _git_describe(pkg_dir: Path) -> tuple[str, str]:
    """(short hash, branch) when deepnvme runs from a git checkout; ('unknown', 'unknown') otherwise."""
    root = pkg_dir.parent
    if not (root / ".git").exists():
        return "unknown", "unknown"
    sha = _capture(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], timeout=2)
    branch = _capture(["git", "-C", str(root), "rev-parse", "--abbrev-ref", "HEAD"], timeout=2)
    return (sha or "unknown").strip(), (branch or "unknown").strip()


def _installed_record() -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The prebuilt ops and the torch they were built for, as setup.py recorded them; empty when JIT only."""
    try:
        mod = importlib.import_module("deepnvme._installed_ops")
    except ModuleNotFoundError as exc:
        if exc.name != "deepnvme._installed_ops":
            raise
        return {}, None
    return dict(getattr(mod, "installed_ops", {}) or {}), getattr(mod, "torch_info", None)


def _major_minor(version: str | None) -> str | None:
    """'2.13.0+cpu' -> '2.13'; prebuilt ops are tied to torch's major.minor ABI."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return f"{match.group(1)}.{match.group(2)}" if match else None


def gather_environment(torch: dict[str, Any], torch_built: dict[str, Any] | None) -> dict[str, Any]:
    """The general environment block, in DeepSpeed's order, keyed for JSON."""
    pkg_dir = Path(__file__).resolve().parent
    sha, branch = _git_describe(pkg_dir)
    env: dict[str, Any] = {
        "torch_install_path": torch["path"],
        "torch_version": torch["version"],
        "deepnvme_install_path": [str(pkg_dir)],
        "deepnvme_info": f"{__version__}, {sha}, {branch}",
    }
    if torch["cuda"]:
        env["torch_cuda_version"] = torch["cuda"]
    nvcc = _nvcc_path()
    if nvcc:
        env["nvcc_version"] = _nvcc_version(nvcc)
    elif torch["cuda"]:
        env["nvcc_version"] = None
    if torch_built and torch_built.get("version"):
        built = f"torch {_major_minor(str(torch_built['version'])) or torch_built['version']}"
        cuda_built = torch_built.get("cuda_version")
        if cuda_built and str(cuda_built) not in ("0.0", "None"):
            built += f", cuda {cuda_built}"
        env["deepnvme_wheel_compiled_w"] = built
    else:
        env["deepnvme_wheel_compiled_w"] = None
    shm_text, shm_bytes = _shm_size()
    env["shm_size"] = shm_text
    env["shm_size_bytes"] = shm_bytes
    return env


# Text labels for the environment keys, in display order; JSON keeps the snake_case keys.
ENV_LABELS = {
    "torch_install_path": "torch install path",
    "torch_version": "torch version",
    "deepnvme_install_path": "deepnvme install path",
    "deepnvme_info": "deepnvme info",
    "torch_cuda_version": "torch cuda version",
    "nvcc_version": "nvcc version",
    "deepnvme_wheel_compiled_w": "deepnvme wheel compiled w.",
    "shm_size": "shared memory (/dev/shm) size",
}


# ----------------------------------------------------------------------------------------------------
# Ops and probes


def _op_reason(builder: Any) -> str:
    """The builder's own account of why it is not compatible, wherever this op_builder keeps it."""
    for attr in ("incompatible_reason", "error_log", "reason"):
        value = getattr(builder, attr, None)
        if callable(value):
            try:
                value = value()
            except Exception:  # noqa: BLE001 - a reason we cannot read is simply absent
                value = None
        if value:
            return str(value).strip()
    return ""


def gather_ops(
    all_ops: dict[str, Any],
    installed: dict[str, Any],
    torch: dict[str, Any],
    torch_built: dict[str, Any] | None,
) -> list[OpRow]:
    """One row per registered op: prebuilt for this torch?, compatible for a JIT build?, and why not."""
    rows = []
    built = ((torch_built or {}).get("version"), (torch_built or {}).get("cuda_version"))
    running = (torch["version"], torch["cuda"])
    for name, builder in all_ops.items():
        reason = ""
        try:
            compatible = bool(builder.is_compatible(verbose=False))
        except Exception as exc:  # noqa: BLE001 - a plugin's broken probe shows as [NO], not a traceback
            compatible, reason = False, f"is_compatible raised {type(exc).__name__}: {exc}"
        if not compatible and not reason:
            reason = _op_reason(builder) or "not compatible (the builder gave no reason)"
        is_installed = bool(installed.get(name))
        if is_installed and built != running:
            # As OpBuilder.load() decides: a prebuilt op for another torch/CUDA is skipped for a JIT build.
            is_installed = False
            stale = (
                f"prebuilt for torch {built[0]} (CUDA {built[1]}), running torch {running[0]} "
                f"(CUDA {running[1]}): load() JIT compiles instead"
            )
            reason = "; ".join(filter(None, [stale, reason]))
        rows.append(OpRow(name, is_installed, compatible, reason))
    return rows


def gather_probes() -> tuple[dict[str, Finding], str | None]:
    """Run op_builder's probes concurrently (compile-and-link checks); error text if op_builder is absent."""
    specs = [
        ("compiler", "compiler", "compiler"),
        ("ninja", "ninja", "ninja"),
        ("libaio", "libaio", "libaio"),
        ("liburing", "liburing", "liburing"),
        ("io_uring_runtime", "io_uring runtime", "io_uring_runtime"),
        ("cuda", "CUDA", "cuda"),
        ("cufile", "cuFile (GDS)", "cufile"),
    ]
    try:
        probe = importlib.import_module("op_builder.probe")
    except Exception as exc:  # noqa: BLE001 - the report must still explain a broken install
        why = f"op_builder.probe cannot be imported: {type(exc).__name__}: {exc}"
        fix = "reinstall deepnvme (pip install .) so that op_builder is importable"
        return {key: Finding(key, label, False, "unknown", why, fix) for key, label, _ in specs}, why

    def one(spec: tuple[str, str, str]) -> Finding:
        key, label, func = spec
        return _run_probe(key, label, getattr(probe, func))

    # Probes spend their time in the compiler, so threads overlap them; each is cached for the op table after.
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        found = list(pool.map(one, specs))
    return {f.key: f for f in found}, None


def engines_finding(usable: bool, probes: dict[str, Finding], async_reason: str) -> tuple[Finding, list[str]]:
    """Which async_io engines this machine will run; posix threads needs only the op itself."""
    key, label = "async_io_engines", "async_io engines"
    if not usable:
        return Finding(
            key,
            label,
            False,
            "none: async_io can neither be loaded prebuilt nor JIT compiled",
            async_reason or "async_io is not compatible",
            probes["compiler"].fix or probes["ninja"].fix or "install a C++ compiler and ninja",
        ), []
    engines, missing = [], []
    if probes["liburing"].ok and probes["io_uring_runtime"].ok:
        engines.append(ENGINE_URING)
    else:
        why = probes["liburing"].reason if not probes["liburing"].ok else probes["io_uring_runtime"].reason
        missing.append(f"io_uring ({why or 'unavailable'})")
    if probes["libaio"].ok:
        engines.append(ENGINE_LIBAIO)
    else:
        missing.append(f"libaio ({probes['libaio'].reason or 'unavailable'})")
    engines.append(ENGINE_POSIX)
    detail = (
        ", ".join(e if e != ENGINE_POSIX else "posix threads" for e in engines) + f"; auto picks {engines[0]}"
    )
    if not missing:
        return Finding(key, label, True, detail), engines
    reason = "missing " + "; ".join(missing)
    if len(engines) == 1:
        reason += (
            "; async_io still works through its posix thread engine (pread/pwrite on worker threads), "
            "slower than a kernel queue"
        )
    fix = "; ".join(
        filter(
            None,
            [
                probes["liburing"].fix if not probes["liburing"].ok else "",
                probes["io_uring_runtime"].fix
                if probes["liburing"].ok and not probes["io_uring_runtime"].ok
                else "",
                probes["libaio"].fix if not probes["libaio"].ok else "",
            ],
        )
    )
    return Finding(key, label, True, detail, reason, fix), engines


def gather(directory: str) -> Report:
    """Collect the whole report; runs probes (compile checks) but never compiles an op."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        probes_job = pool.submit(gather_probes)
        o_direct = check_o_direct(directory)
        torch = _torch_info()
        installed, torch_built = _installed_record()
        environment = gather_environment(torch, torch_built)
        probes, import_error = probes_job.result()

    rows: list[OpRow] = []
    if import_error is None:
        try:
            all_ops = dict(importlib.import_module("op_builder").ALL_OPS)
        except Exception as exc:  # noqa: BLE001 - a broken plugin entry point must not hide the rest
            import_error = f"op_builder.ALL_OPS failed: {type(exc).__name__}: {exc}"
            all_ops = {}
        rows = gather_ops(all_ops, installed, torch, torch_built)
    aio = next((r for r in rows if r.name == "async_io"), None)
    usable = aio is not None and (aio.installed or aio.compatible)
    aio_reason = import_error or (aio.reason if aio else "async_io is not registered in op_builder.ALL_OPS")
    engines, engine_list = engines_finding(usable, probes, aio_reason)

    capabilities = [
        probes["compiler"],
        probes["ninja"],
        probes["libaio"],
        probes["liburing"],
        probes["io_uring_runtime"],
        o_direct,
        check_memlock(),
        probes["cuda"],
        probes["cufile"],
        engines,
    ]
    env_warnings = []
    if environment["shm_size_bytes"] is not None and environment["shm_size_bytes"] < SHM_WANTED:
        env_warnings.append(
            "/dev/shm is smaller than 512 MB; in Docker start the container with --shm-size=1g"
        )
    return Report(
        ninja=probes["ninja"],
        ops=rows,
        environment=environment,
        env_warnings=env_warnings,
        capabilities=capabilities,
        async_io_usable=usable,
        engines=engine_list,
    )


# ----------------------------------------------------------------------------------------------------
# Rendering


class Painter:
    """Colours markers only when asked to; keeps the plain text identical otherwise."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str, colour: str) -> str:
        """Wrap text in an ANSI colour when enabled."""
        return f"{colour}{text}{END}" if self.enabled else text


def want_colour(stream: TextIO) -> bool:
    """Colour only on a terminal, and never when NO_COLOR is set to a non-empty value (no-color.org)."""
    if os.environ.get("NO_COLOR"):
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def _dots(label: str, width: int) -> str:
    """Dot leader for DeepSpeed's layout; at least one dot so long plugin names still read as a row."""
    return "." * max(1, width - len(label))


def _marker(finding: Finding, paint: Painter) -> str:
    """[OKAY] when fine, [WARNING] when usable with a caveat, [NO] when missing."""
    if finding.ok and not finding.reason:
        return paint("[OKAY]", GREEN)
    if finding.ok:
        return paint("[WARNING]", YELLOW)
    return paint("[FAIL]", RED) if finding.key == "async_io_engines" else paint("[NO]", YELLOW)


def _wrapped(prefix: str, text: str, indent: int) -> list[str]:
    """A possibly multi-line reason under its prefix; compiler output is cut to its last lines."""
    first, *rest = text.strip().splitlines() or [""]
    lines = [f"{prefix}{first}"]
    if len(rest) > TEXT_TAIL_LINES:
        lines.append(" " * indent + f"... ({len(rest) - TEXT_TAIL_LINES} more lines in ds_report --json)")
        rest = rest[-TEXT_TAIL_LINES:]
    return lines + [" " * indent + ln.strip() for ln in rest]


def render_text(report: Report, directory: str, paint: Painter, show_warnings: bool) -> str:
    """DeepSpeed's op table and environment block, then deepnvme's capability lines."""
    out: list[str] = []
    okay, no, yes = paint("[OKAY]", GREEN), paint("[NO]", YELLOW), paint("[YES]", GREEN)
    if report.ops is not None and report.ninja is not None:
        out += [
            SEPARATOR,
            "deepnvme C++/CUDA extension op report",
            SEPARATOR,
            "NOTE: an op that is not installed (prebuilt) is compiled just in",
            "      time (JIT) on its first load(). 'compatible' means this machine",
            "      has everything that JIT build of the op needs.",
            SEPARATOR,
            "JIT compiled ops requires ninja",
            f"ninja {'.' * 18} {okay if report.ninja.ok else paint('[FAIL]', RED)}",
            SEPARATOR,
            "op name ................ installed .. compatible",
            SEPARATOR,
        ]
        for row in report.ops:
            installed = "[YES]" if row.installed else "[NO]"
            shown = yes if row.installed else no
            out.append(
                f"{row.name} {_dots(row.name, OP_NAME_WIDTH)} {shown} "
                f"{'.' * (MARKER_WIDTH - len(installed))} {okay if row.compatible else no}"
            )
            if row.reason and show_warnings:
                out += _wrapped(f" {paint('[WARNING]', YELLOW)} {row.name}: ", row.reason, 6)
        out.append(SEPARATOR)

    out.append("deepnvme general environment info:")
    env = report.environment
    for key, label in ENV_LABELS.items():
        if key not in env:
            continue
        value = env[key]
        if key == "nvcc_version" and value is None:
            value = paint("[FAIL] nvcc not found or unreadable; set CUDA_HOME", RED)
        elif key == "deepnvme_wheel_compiled_w" and value is None:
            value = "none (no prebuilt ops; every op is JIT compiled)"
        out.append(f"{label} {_dots(label, ENV_NAME_WIDTH)} {value}")
    if show_warnings:
        out += [paint(f" [WARNING] {w}", YELLOW) for w in report.env_warnings]

    out += [SEPARATOR, f"deepnvme I/O capabilities (O_DIRECT tested in {directory})", SEPARATOR]
    for cap in report.capabilities:
        out.append(
            f"{cap.label} {_dots(cap.label, ENV_NAME_WIDTH)} {_marker(cap, paint)} {cap.detail}".rstrip()
        )
        if cap.reason:
            out += _wrapped("    reason: ", cap.reason, 12)
        if cap.fix:
            out += _wrapped("    fix:    ", cap.fix, 12)
    out.append(SEPARATOR)
    return "\n".join(out) + "\n"


def render_json(report: Report, directory: str) -> str:
    """The same content as one JSON object: ops, environment, capabilities, and the verdict on async_io."""
    doc: dict[str, Any] = {"deepnvme_version": __version__, "dir": directory}
    if report.ops is not None and report.ninja is not None:
        doc["ninja"] = report.ninja.ok
        doc["ops"] = [asdict(r) for r in report.ops]
    doc["environment"] = report.environment
    doc["warnings"] = report.env_warnings
    doc["capabilities"] = [asdict(c) for c in report.capabilities]
    doc["async_io_usable"] = report.async_io_usable
    doc["async_io_engines"] = report.engines
    return json.dumps(doc, indent=2) + "\n"


# ----------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """DeepSpeed's two flags plus --json and --dir."""
    parser = argparse.ArgumentParser(
        prog="ds_report", description="Report which deepnvme ops this machine can build and run, and why not."
    )
    parser.add_argument(
        "--hide_operator_status", action="store_true", help="skip the op table (ninja, installed, compatible)"
    )
    parser.add_argument(
        "--hide_errors_and_warnings",
        action="store_true",
        help="do not print per-op reasons and environment warnings",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument(
        "--dir",
        default=os.getcwd(),
        help="directory in which to test O_DIRECT (default: the current directory)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, stream: TextIO | None = None) -> int:
    """Print the report; return 0 when async_io is usable (prebuilt or JIT compatible), 1 otherwise."""
    args = parse_args(argv)
    stream = stream or sys.stdout
    directory = os.path.abspath(args.dir)
    # The op table is needed for the exit status even when it is hidden from the output.
    report = gather(directory)
    if args.hide_operator_status:
        report.ops, report.ninja = None, None
    if args.json:
        stream.write(render_json(report, directory))
    else:
        stream.write(
            render_text(
                report,
                directory,
                Painter(want_colour(stream)),
                show_warnings=not args.hide_errors_and_warnings,
            )
        )
    stream.flush()
    return 0 if report.async_io_usable else 1


def cli_main() -> None:
    """Console-script entry point (`ds_report`)."""
    sys.exit(main())


if __name__ == "__main__":
    cli_main()
