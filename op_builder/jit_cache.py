"""The JIT cache: where builds live, the key and stamp that let a warm load skip ninja, and our build lock.

Pieces, each usable alone (as torch's cpp_extension keeps its versioner and file baton apart):

- :func:`extensions_root`: ``$TORCH_EXTENSIONS_DIR``, else a deepnvme folder in the user's cache folder.
- :func:`jit_key`: sha256 over every input of a build (sources, included headers, flags, torch, Python,
  compiler, deepnvme version).
- the stamp (``deepnvme_stamp.json``): the key, the probe outcomes and the identity of the library built
  under it; :func:`load_warm` imports that library straight from its file when everything still matches.
- :class:`BuildLock`: an ``flock`` on our own file, which dies with its holder, so a killed build never
  blocks the next one. torch's own lock file is never touched: if a killed build left one behind, the
  build moves to a fresh sub-folder (:func:`torch_build_dir`) and says so.
- :func:`build`: the build itself, through the public :func:`torch.utils.cpp_extension.load`.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import diagnose, sanitize
from .capability import Capability
from .toolchain import compiler_identity

if TYPE_CHECKING:
    from .builder import OpBuilder

__all__ = ["STAMP_FILE", "BuildLock", "build", "extensions_root", "jit_key", "load_warm", "read_stamp",
           "torch_build_dir"]

STAMP_FILE = "deepnvme_stamp.json"
LOCK_FILE = ".deepnvme-build.lock"
_STAMP_VERSION = 2
_TORCH_LOCK = "lock"  # the file torch.utils.cpp_extension.load() creates in its build folder


def extensions_root() -> Path:
    """Root of JIT builds: ``$TORCH_EXTENSIONS_DIR``, else ``deepnvme/jit-<python>`` in the user's cache
    folder (``$XDG_CACHE_HOME``, else ``~/.cache``).

    A folder of our own, not torch's ``get_default_build_root()``: asking torch means importing
    ``torch.utils.cpp_extension`` (about 0.13 s here), which a warm load otherwise never does and which would
    triple its time beyond ``import torch``. Builds are keyed by torch and compiler anyway (:func:`jit_key`).
    """
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "deepnvme" / f"jit-{sys.implementation.cache_tag}"


def _file_identity(path: Path) -> list[int] | None:
    """Size and modification time of a built library: a file replaced since the stamp was written (another
    build, a copy) no longer matches, so the fast path never imports a library it did not build."""
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def jit_key(builder: OpBuilder) -> str:
    """sha256 over every input of the builder's build: sources, headers under its include paths, flags,
    torch, Python ABI, compiler and deepnvme version."""
    import torch

    from .builder import deepnvme_version

    h = hashlib.sha256()

    def add(label: str, value: object) -> None:
        h.update(f"{label}={value!r}\n".encode())

    add("stamp", _STAMP_VERSION)
    add("deepnvme", deepnvme_version())
    add("op", (builder.name, builder.jit_module_name(), type(builder).__module__, type(builder).__qualname__))
    add("torch", (torch.__version__, torch.version.cuda, getattr(torch.version, "hip", None)))
    add("python", (sys.implementation.cache_tag, sysconfig.get_config_var("SOABI")))
    add("compiler", compiler_identity())
    add("cxx", builder.cxx_args())
    add("nvcc", builder.nvcc_args() if builder.with_cuda() else [])
    add("ld", builder.extra_ldflags())
    includes = [builder.src_path(p) for p in builder.include_paths()]
    add("include", [str(p) for p in includes])
    add("with_cuda", builder.with_cuda())
    files = {builder.src_path(s) for s in builder.sources()}
    for inc in includes:
        if inc.is_dir():
            files.update(p for p in inc.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in sorted(files):
        add("file", str(path))
        try:
            h.update(path.read_bytes())
        except OSError:
            add("missing", str(path))
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ stamp
def read_stamp(build_dir: Path) -> dict[str, Any] | None:
    """The stamp of a build folder, or None when absent or unreadable."""
    try:
        data = json.loads((build_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def saved_probes(memo: dict[str, Any]) -> dict[str, Any]:
    """Probe outcomes as JSON: capabilities and flag lists."""
    out: dict[str, Any] = {}
    for name, value in memo.items():
        if isinstance(value, Capability):
            out[name] = {"type": "capability", "value": asdict(value)}
        elif isinstance(value, (list, tuple)):
            out[name] = {"type": "list", "value": list(value)}
    return out


def restored_probes(saved: dict[str, Any]) -> dict[str, Any]:
    """The probe outcomes a stamp recorded, as the builder's memo holds them."""
    memo: dict[str, Any] = {}
    for name, entry in saved.items():
        if isinstance(entry, dict) and entry.get("type") == "capability":
            memo[name] = Capability(**entry["value"])
        elif isinstance(entry, dict) and entry.get("type") == "list":
            memo[name] = list(entry["value"])
    return memo


def _write_stamp(build_dir: Path, data: dict[str, Any]) -> None:
    # Atomic replace: a concurrent reader sees the old stamp or the new one, never half of one.
    fd, tmp = tempfile.mkstemp(prefix=".stamp.", dir=build_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, build_dir / STAMP_FILE)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def _import_extension(name: str, path: Path) -> ModuleType:
    """Import a compiled extension straight from its file (what torch does after a build)."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot make an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def load_warm(builder: OpBuilder, build_dir: Path) -> ModuleType | None:
    """The stamped library when the probes' inputs, the key and the library file all still match.

    Restores the stamp's probe outcomes into the builder first (so computing the key runs no compiler);
    leaves them empty when the stamp is for another machine state.
    """
    stamp = read_stamp(build_dir)
    builder.restore_probe_outcomes({})
    if not stamp or stamp.get("fingerprint") != builder.probe_fingerprint():
        return None
    builder.restore_probe_outcomes(restored_probes(stamp.get("probes", {})))
    library = build_dir / str(stamp.get("library", ""))
    if stamp.get("key") != builder.jit_key() or _file_identity(library) != stamp.get("library_id"):
        builder.restore_probe_outcomes({})
        return None
    try:
        return _import_extension(str(stamp["module"]), library)
    except ImportError:
        builder.restore_probe_outcomes({})
        return None  # e.g. a library it links moved away: the caller rebuilds


# ------------------------------------------------------------------------------------------------- lock
class BuildLock:
    """Exclusive ``flock`` on ``<build_dir>/.deepnvme-build.lock``: one process builds, the others wait.
    The kernel drops it when its holder dies, so it can never be left stale."""

    def __init__(self, build_dir: Path) -> None:
        self.path = build_dir / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> BuildLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


def torch_build_dir(build_dir: Path) -> Path:
    """The folder torch builds in, chosen under our lock: ``build_dir`` itself, or, if a killed build left
    torch's lock file there (torch would wait on it forever), the first ``retry-<n>`` sub-folder without
    one. torch's file is left where it is; the warning says how to reclaim the folder."""
    candidate, n = build_dir, 0
    while (candidate / _TORCH_LOCK).exists():
        n += 1
        candidate = build_dir / f"retry-{n}"
    if n:
        warnings.warn(f"deepnvme: {build_dir / _TORCH_LOCK} was left by a build that did not finish; "
                      f"building in {candidate} instead (delete that lock file, when no build runs, to "
                      f"build in {build_dir} again)", RuntimeWarning, stacklevel=4)
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate


# ------------------------------------------------------------------------------------------------ build
def _stale_library(build_dir: Path) -> tuple[Path, list[int] | None] | None:
    """A library replaced since our stamp was written is newer than every object, so ninja would keep it:
    noted before the lock, removed under it, to force the relink."""
    old = read_stamp(build_dir)
    if old and old.get("library"):
        lib = build_dir / str(old["library"])
        if lib.is_file() and _file_identity(lib) != old.get("library_id"):
            return lib, _file_identity(lib)
    return None


def build(builder: OpBuilder, build_dir: Path, verbose: bool) -> ModuleType:
    """Build (or let ninja bring up to date) and import the op, then stamp it; RuntimeError with the
    compiler's last lines and a fix when the build fails."""
    key = builder.jit_key()  # before building: an edit made during the build must trigger the next one
    srcs = [str(builder.src_path(s)) for s in builder.sources()]
    incs = [str(builder.src_path(p)) for p in builder.include_paths()]
    cflags, ldflags = builder.cxx_args(), builder.extra_ldflags()
    build_dir.mkdir(parents=True, exist_ok=True)
    foreign = _stale_library(build_dir)
    # A stale stamp must not send another process to the fast path while this one relinks.
    (build_dir / STAMP_FILE).unlink(missing_ok=True)
    from torch.utils import cpp_extension

    with BuildLock(build_dir):
        if foreign and _file_identity(foreign[0]) == foreign[1]:
            foreign[0].unlink(missing_ok=True)
        where = torch_build_dir(build_dir)
        try:
            with sanitize.compiler_environment():
                module = cpp_extension.load(
                    name=builder.jit_module_name(), sources=srcs, extra_cflags=cflags, extra_ldflags=ldflags,
                    extra_cuda_cflags=builder.nvcc_args() if builder.with_cuda() else None,
                    extra_include_paths=incs, build_directory=str(where), verbose=verbose,
                    with_cuda=True if builder.with_cuda() else None)
        except Exception as exc:  # torch raises RuntimeError (build) or ImportError (load) with the log
            log = str(exc)
            if getattr(exc, "output", None):
                log += "\n" + (exc.output.decode(errors="replace") if isinstance(exc.output, bytes)
                               else str(exc.output))
            raise RuntimeError(
                f"Building op '{builder.name}' failed.\nreason (compiler's last lines):\n"
                f"{diagnose.tail(log)}\nfix: {diagnose.build_fix(log)}\nbuild folder: {where}") from exc
        # Still under the lock: no other process may relink between our link and the identity we record.
        library = Path(getattr(module, "__file__", "") or "")
        _write_stamp(build_dir, {
            "key": key, "fingerprint": builder.probe_fingerprint(),
            "probes": saved_probes(builder.probe_outcomes()),
            "module": module.__name__, "library": os.path.relpath(library, build_dir),
            "library_id": _file_identity(library),
            "flags": {"sources": srcs, "cxx": cflags, "ld": ldflags, "include": incs}})
    return module
