"""The JIT cache: where builds live, the key and stamp that let a warm load skip ninja, and our build lock.

It works on a plain :class:`~.build_spec.BuildSpec` (names, paths, flags, recorded probe outcomes), never on
a builder. Pieces, each usable alone (as torch's cpp_extension keeps its versioner and file baton apart):

- :func:`extensions_root`: ``$TORCH_EXTENSIONS_DIR``, else a deepnvme folder in the user's cache folder;
  :func:`build_folder`: one folder in it per op and source tree.
- :func:`key_parts` / :func:`jit_key`: a digest of every input of a build (sources, included headers, flags,
  torch, Python, compiler, deepnvme version), kept by part so that a miss names what changed.
- the stamp (``deepnvme_stamp.json``): the key and its parts, the probe outcomes and the identity of the
  library built under it; :func:`recorded_probes` hands the outcomes back while the probes' inputs are
  unchanged, and :func:`load_warm` imports the library straight from its file when everything still matches
  (or says why not).
- :class:`BuildLock`: an ``flock`` on our own file, which dies with its holder, so a killed build never
  blocks the next one; under it, :func:`torch_build_dir` clears a torch lock file that a killed build left
  in our folder (one no live process holds), so that the next build runs in the normal folder.
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
import warnings
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

from . import diagnose, sanitize
from .atomic_file import replace_bytes
from .build_spec import BuildSpec
from .capability import Capability
from .toolchain import compiler_identity

__all__ = ["STAMP_FILE", "BuildLock", "build", "build_folder", "changed_parts", "extensions_root", "jit_key",
           "key_parts", "load_warm", "read_stamp", "recorded_probes", "torch_build_dir"]

STAMP_FILE = "deepnvme_stamp.json"
LOCK_FILE = ".deepnvme-build.lock"
_STAMP_VERSION = 3
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


def build_folder(root: Path, module_name: str, source_root: Path) -> Path:
    """The build folder of one op from one source tree: ``<root>/<module name>-<tag of the tree's path>``.

    One folder per source tree (a checkout, a worktree, an install), not per op name: two trees share the
    cache folder but never build over each other's library and stamp, which would send every load of the
    other tree to a rebuild (and to its compiler probes). Edits within a tree reuse its folder, so ninja
    rebuilds only what changed.
    """
    tag = hashlib.sha256(str(source_root.resolve()).encode()).hexdigest()[:10]
    return root / f"{module_name}-{tag}"


def _file_identity(path: Path) -> list[int] | None:
    """Size and modification time of a built library: a file replaced since the stamp was written (another
    build, a copy) no longer matches, so the fast path never imports a library it did not build."""
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def key_parts(spec: BuildSpec) -> dict[str, str]:
    """Every input of a build, by name, each as a digest: the sources and every file under the include
    folders (``file <path>``), the flags, torch, Python ABI, compiler and deepnvme version. The stamp keeps
    them, so that a load that is not warm can say which one changed."""
    import torch

    parts: dict[str, str] = {}

    def add(label: str, value: object) -> None:
        parts[label] = hashlib.sha256(repr(value).encode()).hexdigest()

    add("stamp version", _STAMP_VERSION)
    add("deepnvme version", spec.version)
    add("op", (spec.name, spec.module_name, *spec.origin))
    add("torch", (torch.__version__, torch.version.cuda, getattr(torch.version, "hip", None)))
    add("python", (sys.implementation.cache_tag, sysconfig.get_config_var("SOABI")))
    add("compiler", compiler_identity())
    add("cxx flags", list(spec.cxx_flags))
    add("nvcc flags", list(spec.nvcc_flags) if spec.with_cuda else [])
    add("ld flags", list(spec.ld_flags))
    add("include dirs", list(spec.include_dirs))
    add("with_cuda", spec.with_cuda)
    files = {Path(s) for s in spec.sources}
    for inc in map(Path, spec.include_dirs):
        if inc.is_dir():
            files.update(p for p in inc.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    for path in sorted(files):
        try:
            parts[f"file {path}"] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            parts[f"file {path}"] = "missing"
    return parts


def jit_key(spec: BuildSpec) -> str:
    """sha256 over :func:`key_parts`: one value that changes when any input of the build does."""
    return _digest(key_parts(spec))


def _digest(parts: dict[str, str]) -> str:
    h = hashlib.sha256()
    for label in sorted(parts):
        h.update(f"{label}={parts[label]}\n".encode())
    return h.hexdigest()


def changed_parts(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """The names of the key parts that differ between two :func:`key_parts` (added and removed included)."""
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


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
    # A stamp that cannot be written costs the next load a rebuild (ninja finds it up to date), never this
    # build: the module is built and imported already.
    try:
        replace_bytes(str(build_dir / STAMP_FILE), json.dumps(data, indent=1).encode())
    except OSError as exc:
        warnings.warn(f"deepnvme: cannot write {build_dir / STAMP_FILE} ({exc}); the next load will check "
                      "the build with ninja again", RuntimeWarning, stacklevel=3)


def _import_extension(name: str, path: Path) -> ModuleType:
    """Import a compiled extension straight from its file (what torch does after a build)."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot make an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def recorded_probes(build_dir: Path, fingerprint: str) -> tuple[dict[str, Any] | None, str]:
    """The probe outcomes the build folder's stamp recorded, when they were taken under ``fingerprint`` (the
    probes' inputs as they are now); else None and why not. Restored into a builder before it computes its
    flags, they spare a warm load every compiler run."""
    stamp = read_stamp(build_dir)
    if not stamp:
        return None, f"no stamp in {build_dir} (never built here, or a build did not finish)"
    old = str(stamp.get("fingerprint", ""))
    if old != fingerprint:
        old_state, _, old_cpu = old.partition("/")
        new_state, _, new_cpu = fingerprint.partition("/")
        sides = (("the compilers, the libraries' headers and files or the probe environment variables",
                  old_state, new_state), ("the CPU", old_cpu, new_cpu))
        what = [name for name, was, now in sides if was != now]
        return None, f"the probes' inputs changed since the stamp: {' and '.join(what) or 'stamp format'}"
    return restored_probes(stamp.get("probes", {})), ""


def load_warm(spec: BuildSpec, build_dir: Path) -> tuple[ModuleType | None, str]:
    """The stamped library when the key and the library file still match the stamp, else None; with it,
    why not ("" when warm). Runs no compiler and does not import torch.utils.cpp_extension."""
    stamp = read_stamp(build_dir)
    if not stamp:
        return None, f"no stamp in {build_dir}"
    parts = key_parts(spec)
    if stamp.get("key") != _digest(parts):
        old = stamp.get("key_parts")
        changed = changed_parts(old, parts) if isinstance(old, dict) else ["a stamp of an older layout"]
        more = " ..." if len(changed) > 8 else ""
        return None, "the build's inputs changed: " + ", ".join(changed[:8]) + more
    library = build_dir / str(stamp.get("library", ""))
    found = _file_identity(library)
    if found != stamp.get("library_id"):
        return None, (f"{library} is not the library the stamp recorded (size, mtime_ns {found} against "
                      f"{stamp.get('library_id')}): replaced or removed since")
    try:
        return _import_extension(str(stamp["module"]), library), ""
    except ImportError as exc:
        return None, f"{library} does not import ({exc})"  # e.g. a library it links moved away


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


def _held_open(path: Path) -> bool:
    """Whether any process this one can see has ``path`` open. torch's FileBaton keeps its lock file open
    from creating it to removing it, so a lock file nobody holds was left by a process that died. Where
    processes cannot be listed (no /proc), every lock counts as held."""
    try:
        target = path.stat()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        pids = os.listdir("/proc")
    except OSError:
        return True  # cannot tell: never clear a lock that may be live
    for pid in pids:
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to look at
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                return True
    return False


def torch_build_dir(build_dir: Path) -> Path:
    """The folder torch builds in, chosen under our lock: ``build_dir`` itself, after clearing a torch lock
    file that a killed build left there. Only our lock's holder builds in our folder, so, holding it, a
    torch lock file that no process holds open is stale; one that is held (a build outside deepnvme's lock,
    which torch would wait on) is left alone and the build moves to the first ``retry-<n>`` sub-folder
    without such a lock, with a warning."""
    candidate, n = build_dir, 0
    while True:
        lock = candidate / _TORCH_LOCK
        if not lock.exists():
            break
        if not _held_open(lock):
            lock.unlink(missing_ok=True)  # stale: its owner is dead (see above)
            break
        n += 1
        candidate = build_dir / f"retry-{n}"
    if n:
        warnings.warn(f"deepnvme: {build_dir / _TORCH_LOCK} is held by a process building outside deepnvme's "
                      f"lock; building in {candidate} instead", RuntimeWarning, stacklevel=4)
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


def build(spec: BuildSpec, build_dir: Path, verbose: bool, why: str = "") -> ModuleType:
    """Build (or let ninja bring up to date) and import the op, then stamp it (``why``: the reason the load
    was not warm, kept in the stamp); RuntimeError with the compiler's last lines and a fix when the build
    fails."""
    parts = key_parts(spec)  # before building: an edit made during the build must trigger the next one
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
                    name=spec.module_name, sources=list(spec.sources), extra_cflags=list(spec.cxx_flags),
                    extra_ldflags=list(spec.ld_flags),
                    extra_cuda_cflags=list(spec.nvcc_flags) if spec.with_cuda else None,
                    extra_include_paths=list(spec.include_dirs), build_directory=str(where), verbose=verbose,
                    with_cuda=True if spec.with_cuda else None)
        except Exception as exc:  # torch raises RuntimeError (build) or ImportError (load) with the log
            log = str(exc)
            if getattr(exc, "output", None):
                log += "\n" + (exc.output.decode(errors="replace") if isinstance(exc.output, bytes)
                               else str(exc.output))
            raise RuntimeError(
                f"Building op '{spec.name}' failed.\nreason (compiler's last lines):\n"
                f"{diagnose.tail(log)}\nfix: {diagnose.build_fix(log)}\nbuild folder: {where}") from exc
        # Still under the lock: no other process may relink between our link and the identity we record.
        library = Path(getattr(module, "__file__", "") or "")
        _write_stamp(build_dir, {
            "key": _digest(parts), "key_parts": parts, "fingerprint": spec.fingerprint,
            "probes": saved_probes(spec.probes), "built_because": why,
            "module": module.__name__, "library": os.path.relpath(library, build_dir),
            "library_id": _file_identity(library),
            "flags": {"sources": list(spec.sources), "cxx": list(spec.cxx_flags), "ld": list(spec.ld_flags),
                      "include": list(spec.include_dirs)}})
    return module
